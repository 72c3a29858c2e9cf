"""Webhooks: a tenant's endpoints (endpoints), the events they can subscribe to (catalog), the
outbox written with each state change and the delivery log (outbox), the loop that delivers it
(delivery) and what keeps it safe (security: secrets, Standard Webhooks signatures, SSRF)."""
