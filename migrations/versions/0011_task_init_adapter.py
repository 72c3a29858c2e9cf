"""A task may start its jobs from an uploaded PEFT adapter (purpose "adapter"):
tasks.init_adapter_file_id, null for a task that starts from fresh adapters.

Revision ID: 0011_task_init_adapter
Revises: 0010_usage
Create Date: 2026-11-25 09:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0011_task_init_adapter'
down_revision = '0010_usage'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('tasks', sa.Column('init_adapter_file_id', sa.String(length=40),
                                     sa.ForeignKey('files.id'), nullable=True))


def downgrade() -> None:
    op.drop_column('tasks', 'init_adapter_file_id')
