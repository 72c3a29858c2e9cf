"""Webhooks: webhook_endpoints (a tenant's receivers: URL, event types, signing secret),
webhook_events (each event's body and id, written with the change it tells), webhook_deliveries
(the outbox: one event for one endpoint, pending until delivered or given up) and
webhook_attempts (every attempt: status code or error, duration).

Revision ID: 0008_webhooks
Revises: 0007
Create Date: 2026-11-24 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0008_webhooks'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'webhook_endpoints',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=40), nullable=False),
        sa.Column('url', sa.String(length=2048), nullable=False),
        sa.Column('description', sa.String(length=500), nullable=True),
        sa.Column('event_types', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column('secret', sa.Text(), nullable=False),
        sa.Column('enabled', sa.Boolean(), server_default='true', nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_webhook_endpoints_tenant_created', 'webhook_endpoints',
                    ['tenant_id', 'created_at', 'id'])
    op.create_table(
        'webhook_events',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=40), nullable=False),
        sa.Column('type', sa.String(length=64), nullable=False),
        sa.Column('payload', postgresql.JSON(astext_type=sa.Text()), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_webhook_events_tenant_id', 'webhook_events', ['tenant_id'])
    op.create_table(
        'webhook_deliveries',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('endpoint_id', sa.String(length=40), nullable=False),
        sa.Column('event_id', sa.String(length=40), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
        sa.Column('tries', sa.Integer(), server_default='0', nullable=False),
        sa.Column('last_status_code', sa.Integer(), nullable=True),
        sa.Column('last_error', sa.Text(), nullable=True),
        sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('scheduled_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('lease_token', sa.String(length=40), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['endpoint_id'], ['webhook_endpoints.id'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['event_id'], ['webhook_events.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('endpoint_id', 'event_id',
                            name='uq_webhook_deliveries_endpoint_event'),
    )
    op.create_index('ix_webhook_deliveries_endpoint_created', 'webhook_deliveries',
                    ['endpoint_id', 'created_at', 'id'])
    op.create_index('ix_webhook_deliveries_due', 'webhook_deliveries', ['next_attempt_at'],
                    postgresql_where=sa.text("state = 'pending'"))
    op.create_table(
        'webhook_attempts',
        sa.Column('id', sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column('delivery_id', sa.String(length=40), nullable=False),
        sa.Column('attempted_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('status_code', sa.Integer(), nullable=True),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('duration_ms', sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(['delivery_id'], ['webhook_deliveries.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_webhook_attempts_delivery_id', 'webhook_attempts', ['delivery_id'])


def downgrade() -> None:
    op.drop_table('webhook_attempts')
    op.drop_table('webhook_deliveries')
    op.drop_table('webhook_events')
    op.drop_table('webhook_endpoints')
