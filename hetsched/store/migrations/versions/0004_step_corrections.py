"""step_corrections: the step model's corrections learned from a running fleet

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 20:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('step_corrections',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('model', sa.String(length=200), nullable=False),
    sa.Column('accelerator', sa.String(length=100), nullable=False),
    sa.Column('tp', sa.Integer(), nullable=False),
    sa.Column('engine', sa.String(length=100), nullable=False),
    sa.Column('attention_backend', sa.String(length=100), nullable=False),
    sa.Column('correction', sa.JSON(), nullable=False),
    sa.Column('sd', sa.JSON(), nullable=False),
    sa.Column('observations', sa.Integer(), nullable=False),
    sa.Column('sources', sa.Integer(), nullable=False),
    sa.Column('window_s', sa.Float(), nullable=False),
    sa.Column('residuals', sa.JSON(), nullable=False),
    sa.Column('outliers', sa.JSON(), nullable=False),
    sa.Column('origin', sa.Text(), nullable=False),
    sa.Column('trusted', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('step_corrections', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_step_corrections_model'), ['model'], unique=False)
        batch_op.create_index(batch_op.f('ix_step_corrections_accelerator'), ['accelerator'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('step_corrections', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_step_corrections_accelerator'))
        batch_op.drop_index(batch_op.f('ix_step_corrections_model'))
    op.drop_table('step_corrections')
