"""Samples on demand (issue 44): sample_requests holds a tenant's prompts to be answered by a
finished task's adapters and its base model (queued -> running -> succeeded | failed), claimed by
node daemons under a lease; the prompts and completions go with the task (cascade).

Revision ID: 0015_sample_requests
Revises: 0014_files_sha256_index
Create Date: 2026-11-29 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0015_sample_requests'
down_revision = '0014_files_sha256_index'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'sample_requests',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=40), nullable=False),
        sa.Column('task_id', sa.String(length=40), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('settings', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column('job_ids', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column('samples', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
        sa.Column('node_id', sa.String(length=40), nullable=True),
        sa.Column('lease_token', sa.String(length=40), nullable=True),
        sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_sample_requests_task_id', 'sample_requests', ['task_id'])
    op.create_index('ix_sample_requests_due', 'sample_requests', ['created_at'],
                    postgresql_where=sa.text("state IN ('queued', 'running')"))


def downgrade() -> None:
    op.drop_table('sample_requests')
