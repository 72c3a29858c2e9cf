"""Per-tenant queue limit: tenants.max_queued_tasks (null = unlimited), the most tasks a tenant
may have not yet running nor finished; POST /v1/tasks over it answers 429.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 23:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('tenants', sa.Column('max_queued_tasks', sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column('tenants', 'max_queued_tasks')
