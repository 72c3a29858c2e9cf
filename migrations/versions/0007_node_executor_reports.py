"""Co-location: nodes.executors (the node's shared executors as its daemon last reported them in
a heartbeat: a JSON list of contract.protocol.ExecutorReport) and nodes.executors_at (when). The
scheduler joins tasks to these executors; a report older than node_timeout_s, or of a node that
is down, is never used.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 14:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('nodes', sa.Column('executors', postgresql.JSONB(astext_type=sa.Text()),
                                     nullable=True))
    op.add_column('nodes', sa.Column('executors_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column('nodes', 'executors_at')
    op.drop_column('nodes', 'executors')
