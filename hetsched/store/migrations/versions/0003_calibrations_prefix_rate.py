"""calibrations: prefill attention prices a cached prefix at a rate of its own

A set stored before the step model priced the new tokens' causal triangle and their pairs with a
cached prefix apart used one rate for both; it gets that rate as its prefix rate, so it reads as
it predicted.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 22:20:00
"""

from typing import Any

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

calibrations = sa.table('calibrations', sa.column('id', sa.Integer()), sa.column('constants', sa.JSON()))


def _rewrite(change: Any) -> None:
    connection = op.get_bind()
    for row_id, constants in connection.execute(sa.select(calibrations.c.id, calibrations.c.constants)).all():
        prefill = dict(constants.get('prefill_attention') or {})
        if change(prefill):
            connection.execute(calibrations.update().where(calibrations.c.id == row_id)
                               .values(constants={**constants, 'prefill_attention': prefill}))


def upgrade() -> None:
    def add(prefill: dict[str, float]) -> bool:
        if 'prefix_efficiency' in prefill or 'efficiency' not in prefill:
            return False
        prefill['prefix_efficiency'] = prefill['efficiency']
        return True
    _rewrite(add)


def downgrade() -> None:
    def drop(prefill: dict[str, float]) -> bool:
        return prefill.pop('prefix_efficiency', None) is not None
    _rewrite(drop)
