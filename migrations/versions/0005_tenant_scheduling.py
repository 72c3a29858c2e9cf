"""Operator-set scheduling of tenants: tenants.priority (0-10, default 0: weights the tenant's
tasks in the planner), tenants.max_task_priority (null = the service's default ceiling: the
highest priority a task of the tenant may ask for) and tenants.guaranteed_gpus (null = none: a
share reclaimed for it from tenants borrowing beyond theirs).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 09:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('tenants', sa.Column('priority', sa.Integer(), nullable=False,
                                       server_default='0'))
    op.add_column('tenants', sa.Column('max_task_priority', sa.Integer(), nullable=True))
    op.add_column('tenants', sa.Column('guaranteed_gpus', sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column('tenants', 'guaranteed_gpus')
    op.drop_column('tenants', 'max_task_priority')
    op.drop_column('tenants', 'priority')
