"""The states of a webhook delivery and its transition table, declared once: service.webhooks.outbox
and .delivery move them, the models and the API schemas read them (this module imports no service)."""

from __future__ import annotations

from typing import Literal

from contract.states import StrEnum, values


class DeliveryState(StrEnum):
    PENDING = "pending"  # due at next_attempt_at (or claimed, until its lease ends)
    DELIVERED = "delivered"
    FAILED = "failed"  # given up: its retries ran past webhook_give_up_s


D = DeliveryState

DELIVERY_STATES = tuple(DeliveryState)
# The plain strings, for the API's fields and query parameters (their schema lists the values).
DeliveryStateName = Literal[values(DELIVERY_STATES)]

# Which state may move to which. An attempt moves a pending delivery on (a failed attempt within
# the give-up clock keeps it pending, due later); a redelivery request makes any delivery pending.
DELIVERY_TRANSITIONS: dict[DeliveryState, frozenset[DeliveryState]] = {
    D.PENDING: frozenset({D.PENDING, D.DELIVERED, D.FAILED}),
    D.DELIVERED: frozenset({D.PENDING}),
    D.FAILED: frozenset({D.PENDING}),
}
del D
