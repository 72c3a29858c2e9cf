"""Tracking integrations: a task's `integrations` (W&B, MLflow), one row each, which is also the
outbox of their sync after the task ended (service.tracking).

Revision ID: 0012_tracking_integrations
Revises: 0011_task_init_adapter
Create Date: 2026-11-25 09:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0012_tracking_integrations'
down_revision = '0011_task_init_adapter'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'task_integrations',
        sa.Column('id', sa.String(length=40), primary_key=True),
        sa.Column('task_id', sa.String(length=40),
                  sa.ForeignKey('tasks.id', ondelete='CASCADE'), nullable=False),
        sa.Column('position', sa.Integer(), nullable=False),
        sa.Column('type', sa.String(length=16), nullable=False),
        sa.Column('config', postgresql.JSONB(), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
        sa.Column('last_error', sa.Text(), nullable=True),
        sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('lease_token', sa.String(length=40), nullable=True),
        sa.Column('result', postgresql.JSONB(), nullable=True),
        sa.Column('synced_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint('task_id', 'position', name='uq_task_integrations_task_position'),
    )
    op.create_index('ix_task_integrations_due', 'task_integrations', ['next_attempt_at'],
                    postgresql_where=sa.text("state = 'pending'"))


def downgrade() -> None:
    op.drop_index('ix_task_integrations_due', table_name='task_integrations')
    op.drop_table('task_integrations')
