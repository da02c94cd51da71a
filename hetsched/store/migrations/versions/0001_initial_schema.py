"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 08:19:30.081354
"""

from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('accelerators_seen',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('accelerator', sa.String(length=100), nullable=False),
    sa.Column('host', sa.String(length=200), nullable=False),
    sa.Column('details', sa.JSON(), nullable=False),
    sa.Column('seen_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('accelerators_seen', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_accelerators_seen_accelerator'), ['accelerator'], unique=False)

    op.create_table('models',
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('config', sa.JSON(), nullable=False),
    sa.Column('source', sa.String(length=500), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('plans',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('origin', sa.String(length=20), nullable=False),
    sa.Column('status', sa.String(length=40), nullable=False),
    sa.Column('cost_per_hour', sa.Float(), nullable=True),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('plan', sa.JSON(), nullable=False),
    sa.Column('note', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('plans', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_plans_name'), ['name'], unique=False)

    op.create_table('profiles',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('model', sa.String(length=200), nullable=False),
    sa.Column('accelerator', sa.String(length=100), nullable=False),
    sa.Column('source', sa.String(length=20), nullable=False),
    sa.Column('backend', sa.String(length=20), nullable=False),
    sa.Column('tp', sa.Integer(), nullable=False),
    sa.Column('digest', sa.String(length=64), nullable=False),
    sa.Column('tables', sa.JSON(), nullable=False),
    sa.Column('fitted', sa.JSON(), nullable=False),
    sa.Column('provenance', sa.JSON(), nullable=False),
    sa.Column('sweep', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('digest')
    )
    with op.batch_alter_table('profiles', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_profiles_accelerator'), ['accelerator'], unique=False)
        batch_op.create_index(batch_op.f('ix_profiles_model'), ['model'], unique=False)

    op.create_table('capacities',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('key', sa.String(length=64), nullable=False),
    sa.Column('model', sa.String(length=200), nullable=False),
    sa.Column('device', sa.String(length=100), nullable=False),
    sa.Column('tp', sa.Integer(), nullable=False),
    sa.Column('profile_id', sa.Integer(), nullable=True),
    sa.Column('requests_per_s', sa.Float(), nullable=False),
    sa.Column('inputs', sa.JSON(), nullable=False),
    sa.Column('result', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['profile_id'], ['profiles.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('key')
    )
    with op.batch_alter_table('capacities', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_capacities_device'), ['device'], unique=False)
        batch_op.create_index(batch_op.f('ix_capacities_model'), ['model'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('capacities', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_capacities_model'))
        batch_op.drop_index(batch_op.f('ix_capacities_device'))

    op.drop_table('capacities')
    with op.batch_alter_table('profiles', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_profiles_model'))
        batch_op.drop_index(batch_op.f('ix_profiles_accelerator'))

    op.drop_table('profiles')
    with op.batch_alter_table('plans', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_plans_name'))

    op.drop_table('plans')
    op.drop_table('models')
    with op.batch_alter_table('accelerators_seen', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_accelerators_seen_accelerator'))

    op.drop_table('accelerators_seen')
