"""Pause/resume and the OpenAI-compatible fine-tuning API: a placement the service asked to stop
at a step boundary (stop_requested: 'pause' or 'requeue'); a task's user metadata (string pairs)
and the suffix of its fine-tuned model name.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 09:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('placements', sa.Column('stop_requested', sa.String(length=16), nullable=True))
    op.add_column('tasks', sa.Column('suffix', sa.String(length=64), nullable=True))
    op.add_column('tasks', sa.Column('meta', postgresql.JSONB(astext_type=sa.Text()),
                                     nullable=True))


def downgrade() -> None:
    op.drop_column('tasks', 'meta')
    op.drop_column('tasks', 'suffix')
    op.drop_column('placements', 'stop_requested')
