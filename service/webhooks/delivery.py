"""The deliverer: a thread in every API process that posts due outbox rows to their endpoints.
Several processes deliver side by side: a pass claims due rows with FOR UPDATE SKIP LOCKED and
moves their next_attempt_at past the attempt (a lease), so no two claim a row at once, and a
process that dies mid-attempt leaves the row due again once the lease ends. At least once: the
receiver may see an event twice (after such a death), always with the same webhook-id.

Each attempt re-checks the URL's addresses and connects to the address it checked (see
security.resolve), signs the body with a fresh webhook-timestamp, follows no redirect and reads
at most a little of the answer. A 2xx delivers; anything else waits webhook_backoff_s and tries
again, until webhook_give_up_s after the delivery was scheduled: then it is failed."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta

import httpx
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from contract.background import BackgroundWorker
from service import outbox
from service.core.config import Settings
from service.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent, utcnow
from service.webhooks.outbox import enqueued, move_delivery
from service.webhooks.security import AddressRefused, check_key, resolve, sign, unseal
from service.webhooks.states import DeliveryState

log = logging.getLogger("loraplex.webhooks")
USER_AGENT = "loraplex-webhooks/1"
WORKERS = 8  # attempts at once per process; a pass claims at most this many rows


@dataclass(frozen=True)
class Claim:
    delivery_id: str
    endpoint_id: str
    event_id: str
    url: str
    secret: str  # as stored (sealed)
    body: bytes
    token: str


@dataclass(frozen=True)
class Outcome:
    started: datetime
    status_code: int | None
    error: str | None
    duration_ms: int

    @property
    def delivered(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def lease_s(settings: Settings) -> float:
    """How long a claimed attempt is another process's to leave alone."""
    return 2 * settings.webhook_timeout_s + 5


def claim_due(session: Session, settings: Settings, limit: int = WORKERS) -> list[Claim]:
    """Claim up to `limit` due deliveries of enabled endpoints, oldest due first; commits."""
    ids, token = outbox.claim(session, select(WebhookDelivery.id).join(
        WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .where(WebhookDelivery.state == DeliveryState.PENDING,
               WebhookDelivery.next_attempt_at <= utcnow(),
               WebhookEndpoint.enabled.is_(True), WebhookEndpoint.deleted_at.is_(None))
        .order_by(WebhookDelivery.next_attempt_at).limit(limit),
        WebhookDelivery.next_attempt_at, lease_s(settings))
    if not ids:
        session.rollback()
        return []
    rows = session.execute(
        select(WebhookDelivery.id, WebhookEndpoint.id, WebhookEvent.id, WebhookEndpoint.url,
               WebhookEndpoint.secret, WebhookEvent.payload)
        .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .where(WebhookDelivery.id.in_(ids))).all()
    session.commit()
    return [Claim(delivery_id=d, endpoint_id=e, event_id=ev, url=url, secret=secret,
                  body=json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode(),
                  token=token)
            for d, e, ev, url, secret, payload in rows]


def attempt(claim: Claim, settings: Settings, client: httpx.Client) -> Outcome:
    """POST the event once: signed, to the address checked now, no redirects."""
    started, t0 = utcnow(), time.perf_counter()
    status: int | None = None
    error: str | None = None
    try:
        secret = unseal(claim.secret, settings.webhook_secret_key)
        target = resolve(claim.url, settings.webhook_allow_private)
        timestamp = int(time.time())
        headers = {"content-type": "application/json", "user-agent": USER_AGENT,
                   "host": target.host_header, "webhook-id": claim.event_id,
                   "webhook-timestamp": str(timestamp),
                   "webhook-signature": sign(secret, claim.event_id, timestamp, claim.body)}
        extensions = {"sni_hostname": target.sni_hostname} if target.sni_hostname else {}
        with client.stream("POST", target.url, content=claim.body, headers=headers,
                           extensions=extensions) as response:
            status = response.status_code
            if not 200 <= status < 300:
                head = next(response.iter_raw(256), b"")[:200].decode("utf-8", "replace")
                error = f"HTTP {status}" + (f": {head.strip()}" if head.strip() else "")
    except (AddressRefused, ValueError) as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure is this attempt's, logged and retried
        error = f"{type(exc).__name__}: {exc}"[:500] if str(exc) else type(exc).__name__
    return Outcome(started, status, error, int((time.perf_counter() - t0) * 1000))


def record(session: Session, claim: Claim, outcome: Outcome, settings: Settings) -> str | None:
    """Log the attempt and move the delivery on (delivered, due again later, or failed); the
    delivery's new state, or None when it was redelivered or reclaimed meanwhile (then only the
    attempt is logged). Commits."""
    session.add(WebhookAttempt(delivery_id=claim.delivery_id, attempted_at=outcome.started,
                               status_code=outcome.status_code, error=outcome.error,
                               duration_ms=outcome.duration_ms))
    row = outbox.mine(session, WebhookDelivery, claim.delivery_id, claim.token)
    if row is None:
        session.commit()
        return None
    now = utcnow()
    row.attempts += 1
    row.tries += 1
    row.last_status_code, row.last_error, row.lease_token = (outcome.status_code, outcome.error,
                                                             None)
    if outcome.delivered:
        move_delivery(row, DeliveryState.DELIVERED)
        row.delivered_at, row.next_attempt_at = now, None
    else:
        row.next_attempt_at = outbox.retry_at(
            now, row.tries, settings.webhook_backoff_s,
            row.scheduled_at + timedelta(seconds=settings.webhook_give_up_s))
        if row.next_attempt_at is None:
            move_delivery(row, DeliveryState.FAILED)
    session.commit()
    return row.state


class Deliverer:
    """One process's delivery thread: a pass whenever this process enqueued something and every
    webhook_poll_s; start() in the app's lifespan, stop() at its end (attempts in flight end)."""

    def __init__(self, factory: sessionmaker[Session], settings: Settings) -> None:
        check_key(settings.webhook_secret_key)  # a bad key stops the start, not the first send
        self._factory, self._settings = factory, settings
        self.worker = BackgroundWorker("loraplex-webhooks", lambda: self.run_once() == WORKERS,
                                       every_s=settings.webhook_poll_s, wake=enqueued,
                                       logger=log, stop_s=settings.webhook_timeout_s * 3)
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="loraplex-webhook")
        self._client = httpx.Client(timeout=settings.webhook_timeout_s, follow_redirects=False,
                                    trust_env=False, limits=httpx.Limits(max_connections=WORKERS))

    def start(self) -> Deliverer:
        if not self._settings.webhook_secret_key:
            log.warning("LORAPLEX_WEBHOOK_SECRET_KEY is unset: webhook signing secrets are stored "
                        "unencrypted")
        self.worker.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        self.worker.stop(timeout)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    def run_once(self) -> int:
        """One pass: claim due rows, attempt them concurrently, record each; how many."""
        return outbox.work_due(self._factory, lambda s: claim_due(s, self._settings),
                               self._deliver, self._pool)

    def _deliver(self, claim: Claim) -> None:
        try:
            outcome, state = outbox.attempt_and_record(
                self._factory, claim, lambda c: attempt(c, self._settings, self._client),
                lambda s, c, o: record(s, c, o, self._settings))
        except IntegrityError:  # its tenant was deleted meanwhile
            return
        log.info("webhook attempt delivery=%s event=%s endpoint=%s status=%s state=%s ms=%d%s",
                 claim.delivery_id, claim.event_id, claim.endpoint_id, outcome.status_code,
                 state, outcome.duration_ms, f" error={outcome.error!r}" if outcome.error else "")
