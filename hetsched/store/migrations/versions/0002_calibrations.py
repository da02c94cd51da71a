"""calibrations: step-model constants fitted per device

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 17:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('calibrations',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('accelerator', sa.String(length=100), nullable=False),
    sa.Column('constants', sa.JSON(), nullable=False),
    sa.Column('residuals', sa.JSON(), nullable=False),
    sa.Column('profile_ids', sa.JSON(), nullable=False),
    sa.Column('trusted', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('calibrations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_calibrations_accelerator'), ['accelerator'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('calibrations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_calibrations_accelerator'))
    op.drop_table('calibrations')
