"""A task's settings as one document: tasks.settings (jsonb, contract.protocol.TaskSettings)
replaces the columns validation_split, epochs, max_seq_len, seed, early_exit, eval and
target_modules, so a new setting needs no column and no migration.

Revision ID: 0013_task_settings_document
Revises: 0012_tracking_integrations
Create Date: 2026-11-25 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0013_task_settings_document'
down_revision = '0012_tracking_integrations'
branch_labels = None
depends_on = None

_COLUMNS = ('validation_split', 'epochs', 'max_seq_len', 'seed', 'early_exit', 'eval',
            'target_modules')


def upgrade() -> None:
    op.add_column('tasks', sa.Column('settings', postgresql.JSONB(), nullable=True))
    pairs = ", ".join(f"'{c}', {c}" for c in _COLUMNS)
    op.execute(f"UPDATE tasks SET settings = jsonb_build_object({pairs})")
    op.alter_column('tasks', 'settings', nullable=False)
    for column in _COLUMNS:
        op.drop_column('tasks', column)


def downgrade() -> None:
    op.add_column('tasks', sa.Column('validation_split', sa.Float(), nullable=True))
    op.add_column('tasks', sa.Column('epochs', sa.Integer(), nullable=True))
    op.add_column('tasks', sa.Column('max_seq_len', sa.Integer(), nullable=True))
    op.add_column('tasks', sa.Column('seed', sa.Integer(), nullable=True))
    for column in ('early_exit', 'eval', 'target_modules'):
        op.add_column('tasks', sa.Column(column, postgresql.JSONB(), nullable=True))
    op.execute(
        "UPDATE tasks SET validation_split = (settings->>'validation_split')::float, "
        "epochs = (settings->>'epochs')::int, max_seq_len = (settings->>'max_seq_len')::int, "
        "seed = (settings->>'seed')::int, early_exit = settings->'early_exit', "
        "eval = settings->'eval', target_modules = settings->'target_modules'")
    for column in ('validation_split', 'epochs', 'max_seq_len', 'seed', 'early_exit', 'eval'):
        op.alter_column('tasks', column, nullable=False)
    op.drop_column('tasks', 'settings')
