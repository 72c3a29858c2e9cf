"""Throughput profiles written by executors' reports: the GPU count of the measuring placement
joins the key (tokens_per_s is that whole placement's), plus samples/s and the memory model
M(B) = k0 + k1 * B * L the executor fitted.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

_OLD_KEY = ['base_model', 'gpu_type', 'seq_len', 'batch_key']


def upgrade() -> None:
    # Rows from before were one GPU's rates: they keep that meaning as gpus = 1.
    op.add_column('throughput_profiles',
                  sa.Column('gpus', sa.Integer(), nullable=False, server_default='1'))
    op.alter_column('throughput_profiles', 'gpus', server_default=None)
    op.add_column('throughput_profiles', sa.Column('samples_per_s', sa.Float(), nullable=True))
    op.add_column('throughput_profiles', sa.Column('memory_k0', sa.Float(), nullable=True))
    op.add_column('throughput_profiles', sa.Column('memory_k1', sa.Float(), nullable=True))
    op.drop_constraint('uq_throughput_profiles_key', 'throughput_profiles', type_='unique')
    op.create_unique_constraint('uq_throughput_profiles_key', 'throughput_profiles',
                                [*_OLD_KEY, 'gpus'])


def downgrade() -> None:
    # The old key has no GPU count and meant one GPU: multi-GPU measurements cannot stay.
    op.execute("DELETE FROM throughput_profiles WHERE gpus <> 1")
    op.drop_constraint('uq_throughput_profiles_key', 'throughput_profiles', type_='unique')
    op.create_unique_constraint('uq_throughput_profiles_key', 'throughput_profiles', _OLD_KEY)
    op.drop_column('throughput_profiles', 'memory_k1')
    op.drop_column('throughput_profiles', 'memory_k0')
    op.drop_column('throughput_profiles', 'samples_per_s')
    op.drop_column('throughput_profiles', 'gpus')
