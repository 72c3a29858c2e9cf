"""Merged models: merged_models holds one merge of a job's adapter into its task's base model
(queued -> running -> succeeded | failed), built in the background by service.merged.runner and
stored once per job as one archive blob.

Revision ID: 0009_merged_models
Revises: 0008_webhooks
Create Date: 2026-11-25 07:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0009_merged_models'
down_revision = '0008_webhooks'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'merged_models',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=40), nullable=False),
        sa.Column('task_id', sa.String(length=40), nullable=False),
        sa.Column('job_id', sa.String(length=40), nullable=False),
        sa.Column('artifact_id', sa.String(length=40), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('dtype', sa.String(length=16), nullable=True),
        sa.Column('bytes', sa.BigInteger(), nullable=True),
        sa.Column('storage_key', sa.String(length=200), nullable=True),
        sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
        sa.Column('lease_token', sa.String(length=40), nullable=True),
        sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['artifact_id'], ['artifacts.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('job_id', name='uq_merged_models_job'),
    )
    op.create_index('ix_merged_models_task_id', 'merged_models', ['task_id'])
    op.create_index('ix_merged_models_due', 'merged_models', ['created_at'],
                    postgresql_where=sa.text("state IN ('queued', 'running')"))


def downgrade() -> None:
    op.drop_table('merged_models')
