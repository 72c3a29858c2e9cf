"""Idempotent creates (Idempotency-Key): the digest a key holds is of the canonical request (the
validated body without its defaults), so a retry across an upgrade that adds a setting, or one
that spells a default out, replays; digests earlier versions stored (the JSON as sent; the body
with every default filled in) are accepted too. Another request under a used key is a 409."""

from __future__ import annotations

import hashlib
import json

from sqlalchemy.orm import Session

from contract.settings import STEP_CADENCE
from service.core.errors import conflict
from service.models import IdempotencyKey, Task, Tenant
from service.schemas import TaskCreate

LEGACY_KNOBS = ("learning_rate", "lora_rank", "lora_alpha", "batch_size", "beta")


def request_hash(sent: object) -> str:
    """The digest of a JSON document (keys sorted): of the canonical request (`canonical_request`)
    for the Idempotency-Key, of the JSON as the client sent it for keys stored that way."""
    canonical = json.dumps(sent, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def canonical_request(body: TaskCreate) -> object:
    """What the client asked for: the validated request without the values equal to their
    defaults. A setting an upgrade adds is absent from it as it was from the body sent before, and
    spelling a default out (integrations: []) asks for nothing else: the same digest, a replay."""
    return _pruned(body.model_dump(mode="json", exclude_defaults=True))


def _pruned(value: object) -> object:
    """Empty lists and mappings dropped: an empty list of integrations asks for what none does."""
    if isinstance(value, dict):
        kept = {k: _pruned(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in ([], {})}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def legacy_request_hash(body: TaskCreate) -> str:
    """The digest the version before the canonical one stored (the validated body with every
    default filled in, as that version's schema had it): a key claimed before this upgrade still
    replays. That schema had no `samples` and showed the step cadence 50 beside a sample cadence."""
    data = body.model_dump(mode="json")
    # Newer fields, unset (integrations: or empty): the hash of a body sent before them holds.
    for added in ("suffix", "metadata", "init_adapter_file", "integrations"):
        if data.get(added) is None or (added == "integrations" and not data[added]):
            data.pop(added, None)
    data.pop("samples", None)
    early = data.get("early_exit")  # train_while_waiting (session 42) at its default: not in that schema
    if isinstance(early, dict) and not early.get("train_while_waiting"):
        early.pop("train_while_waiting", None)
    # That schema's search space: the shared knobs and DPO's beta (a method's knob added since,
    # contract.methods, is not in a body that release hashed).
    space = data.get("search_space") or {}
    data["search_space"] = {k: v for k, v in space.items() if k in LEGACY_KNOBS}
    cadence = data.get("eval") or {}
    if cadence.get("eval_every_steps") is None and cadence.get("eval_every_samples") is not None:
        cadence["eval_every_steps"] = STEP_CADENCE
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def replay(session: Session, tenant: Tenant, key: str, accepted: tuple[str, ...]
            ) -> Task | None:
    row = session.get(IdempotencyKey, (tenant.id, key))
    if row is None:
        return None
    if row.request_hash not in accepted:
        raise conflict("Idempotency-Key was already used with a different request body",
                       code="idempotency_key_reused", param="Idempotency-Key")
    return session.get(Task, row.resource_id)


def accepted_digests(body: TaskCreate, sent: object = None) -> tuple[str, ...]:
    """The digests a key may hold for this request; the first is the one a new key stores."""
    digest = request_hash(canonical_request(body))
    return digest, request_hash(sent) if sent is not None else digest, legacy_request_hash(body)
