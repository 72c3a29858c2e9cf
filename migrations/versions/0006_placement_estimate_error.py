"""Estimate error feedback: placements.estimated_s (the scheduler's raw duration estimate when it
published the placement) and placements.run_s (claim to finish of an attempt that ended its
task). The scheduler corrects each model's next estimates by the measured ratio.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('placements', sa.Column('estimated_s', sa.Integer(), nullable=True))
    op.add_column('placements', sa.Column('run_s', sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column('placements', 'run_s')
    op.drop_column('placements', 'estimated_s')
