"""Usage: the exact sequence tokens and the GPU-seconds of each job's training step, on its train
loss point (metric_points.tokens, metric_points.gpu_seconds; null on validation points and on
points stored before this revision). Summed per job and per task by service.usage.

Revision ID: 0010_usage
Revises: 0009_merged_models
Create Date: 2026-11-25 07:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0010_usage'
down_revision = '0009_merged_models'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('metric_points', sa.Column('tokens', sa.BigInteger(), nullable=True))
    op.add_column('metric_points', sa.Column('gpu_seconds', sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column('metric_points', 'gpu_seconds')
    op.drop_column('metric_points', 'tokens')
