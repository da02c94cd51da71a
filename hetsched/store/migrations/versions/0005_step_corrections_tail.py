"""step_corrections: the tail learned beside a correction (step dispersion and front end)

A correction stored before keeps no tail (NULL): its replicas are simulated with steps of their mean time and no
front end, as before.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 21:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('step_corrections', schema=None) as batch_op:
        batch_op.add_column(sa.Column('tail', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('step_corrections', schema=None) as batch_op:
        batch_op.drop_column('tail')
