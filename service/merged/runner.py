"""The merger: a thread of the leader (service.api.background) that claims queued merges one at a
time, merges the adapter into its task's base model (service.merged.weights) off the request
path, stores the model's tar archive once and records the outcome. A heartbeat renews the
claim's lease while the merge runs; a merge whose process died is claimed again once its lease
ends. A failure touches only its own row, with a message fit for the tenant."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from contract.background import BackgroundWorker
from service import outbox
from service.adapters import write_archive
from service.core.config import Settings
from service.core.registry import ModelRegistry
from service.core.storage import Storage
from service.merged import lifecycle
from service.merged.lifecycle import Claim
from service.merged.weights import MergeError, merge_adapter

log = logging.getLogger("loraplex.merged")


def run_merge(claim: Claim, storage: Storage, registry: ModelRegistry,
              settings: Settings) -> tuple[str, int, str]:
    """Merge one claimed adapter and store the archive: (storage key, bytes, dtype)."""
    entry = registry.get(claim.base_model)
    if entry is None:
        raise MergeError(f"base model {claim.base_model!r} is no longer registered")
    if not Path(entry.path).is_dir():
        raise MergeError(f"the weights of base model {claim.base_model!r} are not available "
                         "on this service")
    with tempfile.TemporaryDirectory(prefix="loraplex-merge-") as tmp:
        adapter_dir, out_dir = Path(tmp, "adapter"), Path(tmp, "model")
        adapter_dir.mkdir()
        for name, key in claim.files:
            with storage.open(key) as src, \
                    open(adapter_dir / name, "wb") as dst:
                dst.write(src.read())
        dtype = merge_adapter(entry.path, adapter_dir, out_dir, settings.merge_max_shard_size)
        members = [(p.name, p.stat().st_size, partial(p.open, "rb"))
                   for p in sorted(out_dir.iterdir()) if p.is_file()]
        key = lifecycle.archive_key(claim.merged_id)
        with tempfile.TemporaryFile(dir=tmp) as archive:
            write_archive(archive, members, "tar")
            archive.seek(0)
            size = storage.put(key, archive)
    return key, size, dtype


class Merger:
    """The leader's merges, on the leased outbox (service.outbox): ``worker`` runs a pass (claim
    one, merge it with its lease renewed, record the outcome) after each merge, whenever this
    process requested one and every merge_poll_s; start it when elected, stop it when deposed
    (a merge under way finishes in its daemon thread, or its lease ends)."""

    def __init__(self, factory: sessionmaker[Session], settings: Settings, storage: Storage,
                 registry: ModelRegistry) -> None:
        self._factory, self._settings = factory, settings
        self._storage, self._registry = storage, registry
        self.worker = BackgroundWorker("loraplex-merger", self.run_once,
                                       every_s=settings.merge_poll_s, wake=lifecycle.requested,
                                       logger=log, stop_s=5.0)

    def run_once(self) -> bool:
        """Claim and run one merge; False when none was due."""
        return outbox.work_due(self._factory, self._claim, self._merge) > 0

    def _claim(self, session: Session) -> list[Claim]:
        claim = lifecycle.claim_next(session, self._settings)
        return [] if claim is None else [claim]

    def _merge(self, claim: Claim) -> None:
        log.info("merge started merged=%s task=%s job=%s", claim.merged_id, claim.task_id,
                 claim.job_id)
        (end, _), mine = outbox.attempt_and_record(
            self._factory, claim, self._attempt, self._record,
            lambda session, c: lifecycle.renew(session, c, self._settings),
            self._settings.merge_lease_s / 3)
        log.info("merge %s merged=%s task=%s job=%s%s", end.__name__, claim.merged_id,
                 claim.task_id, claim.job_id, "" if mine else " (no longer this claim's)")

    def _attempt(self, claim: Claim) -> tuple[Callable[..., bool], tuple]:
        """The merge's outcome: how to record it (succeed or fail) and with what."""
        try:
            key, size, dtype = run_merge(claim, self._storage, self._registry, self._settings)
        except MergeError as exc:
            return lifecycle.fail, (str(exc),)
        except Exception as exc:  # noqa: BLE001 - logged in full; the tenant sees its kind only
            log.exception("merge crashed merged=%s task=%s job=%s", claim.merged_id,
                          claim.task_id, claim.job_id)
            return lifecycle.fail, (f"the merge failed ({type(exc).__name__}); request it "
                                    "again, or ask the operator",)
        return lifecycle.succeed, (key, size, dtype)

    @staticmethod
    def _record(session: Session, claim: Claim,
                outcome: tuple[Callable[..., bool], tuple]) -> bool:
        end, args = outcome
        return end(session, claim, *args)
