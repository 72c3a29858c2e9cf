"""Uploads deduplicated by content per tenant: an index on files (tenant_id, sha256) so an
upload finds the tenant's file with the same bytes.

Revision ID: 0014_files_sha256_index
Revises: 0013_task_settings_document
Create Date: 2026-11-28 12:00:00
"""

from __future__ import annotations

from alembic import op

revision = '0014_files_sha256_index'
down_revision = '0013_task_settings_document'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_files_tenant_sha256', 'files', ['tenant_id', 'sha256'])


def downgrade() -> None:
    op.drop_index('ix_files_tenant_sha256', table_name='files')
