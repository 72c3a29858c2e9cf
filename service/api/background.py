"""The API's background work, run by exactly one process at a time: every API process has a
replanner that request handlers signal (service.cluster.cluster_changed), but only the leader
(service.core.leader) replans, re-publishes and runs the maintenance loop; a follower forwards its
replan requests to the leader with a NOTIFY and shows the leader's last plan in GET /v1/cluster.
The leader also runs the merger (service.merged.runner): merged models are built one at a time,
and the tracking syncer (service.tracking.sync): ended tasks' runs written to W&B and MLflow."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from datetime import datetime
from functools import partial

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from contract.background import BackgroundWorker, Health
from service.cluster import mark_stale_nodes, replan_due, replan_now
from service.core.config import Settings
from service.core.db import session_scope
from service.core.leader import REPLAN_CHANNEL, Leadership
from service.core.registry import ModelRegistry
from service.core.storage import Storage
from service.merged.runner import Merger
from service.queue import get_redis, republish_all
from service.scheduler.replanner import Replanner, register, unregister
from service.tracking.sync import syncer

log = logging.getLogger("loraplex.background")

PLAN_INFO_KEY = "loraplex:scheduler:last_plan"  # the leader's last PlanInfo, JSON, in Redis


def maintenance_pass(factory: sessionmaker[Session], settings: Settings) -> None:
    """Nodes silent for node_timeout_s go down (their tasks are requeued), and published
    placements missing from Redis are queued again."""
    with session_scope(factory) as session:
        mark_stale_nodes(session, settings)
        republish_all(session, settings)


def maintenance(factory: sessionmaker[Session], settings: Settings) -> BackgroundWorker:
    """The leader's maintenance worker: a pass every maintenance_interval_s."""
    return BackgroundWorker("loraplex-maintenance", partial(maintenance_pass, factory, settings),
                            every_s=settings.maintenance_interval_s, wait_first=True, logger=log,
                            stop_s=10.0)


class Background:
    """One API process's part: start() in the app's lifespan, stop() at its end."""

    def __init__(self, factory: sessionmaker[Session], settings: Settings,
                 storage: Storage | None = None, registry: ModelRegistry | None = None) -> None:
        self._factory, self.settings = factory, settings
        self._storage, self._registry = storage, registry
        self._loops: list[BackgroundWorker] = []  # the leader's, while it leads
        self._lock = threading.Lock()
        self.replanner: Replanner | None = None
        if settings.scheduler_enabled and settings.scheduler_replan == "background":
            self.replanner = Replanner(self._replan, self._due, settings.scheduler_interval_s,
                                       settings.scheduler_debounce_s)
        self.leadership = Leadership(settings.database_url, self._elected, self._deposed,
                                     self._requested, retry_s=settings.leader_retry_s)

    @property
    def is_leader(self) -> bool:
        return self.leadership.is_leader

    def health(self) -> list[Health]:
        """Every background worker of this process: the replanner, the election, the leader's."""
        with self._lock:
            loops = [*([self.replanner.worker] if self.replanner else []),
                     self.leadership.worker, *self._loops]
        return [w.health() for w in loops]

    def start(self) -> Background:
        if self.replanner is not None:
            register(self.settings.database_url, self.replanner)
            self.replanner.start()
        self.leadership.start()
        return self

    def stop(self) -> None:
        self.leadership.stop()  # the loops stop before the lock is released
        if self.replanner is not None:
            unregister(self.settings.database_url, self.replanner)
            self.replanner.stop()

    # Leadership callbacks (the election thread).
    def _elected(self) -> None:
        if self.settings.republish_on_startup:
            try:
                with session_scope(self._factory) as session:
                    republish_all(session, self.settings)
            except Exception as exc:  # Redis may come up later; maintenance republishes then
                log.warning("republish on election failed error=%s", exc)
        loops = []
        if self.settings.maintenance_interval_s > 0:
            loops.append(maintenance(self._factory, self.settings))
        if (self.settings.merge_poll_s > 0 and self._storage is not None
                and self._registry is not None):
            loops.append(Merger(self._factory, self.settings, self._storage,
                                self._registry).worker)
        if self.settings.tracking_poll_s > 0:
            loops.append(syncer(self._factory, self.settings))
        with self._lock:
            self._loops = [w.start() for w in loops]
        if self.replanner is not None:
            self.replanner.trigger("leader_elected")  # publish what became due while none led

    def _deposed(self) -> None:
        with self._lock:
            loops, self._loops = self._loops, []
        for loop in loops:
            loop.stop()

    def _requested(self, payload: str) -> None:
        if self.replanner is not None:
            for reason in payload.split(",") if payload else ["follower"]:
                self.replanner.trigger(reason)

    # Replanner callbacks (the replanner thread).
    def _replan(self, reasons: list[str]) -> None:
        if not self.is_leader:
            with session_scope(self._factory) as session:
                session.execute(text("SELECT pg_notify(:channel, :reasons)"),
                                {"channel": REPLAN_CHANNEL, "reasons": ",".join(reasons)})
            return
        session = self._factory()
        try:
            replan_now(session, self.settings, reasons)
        finally:
            session.close()
        self._share_plan_info()

    def _due(self) -> bool:
        if not self.is_leader:
            self._adopt_plan_info()
            return False
        with session_scope(self._factory) as session:
            return replan_due(session, self.settings)

    def _share_plan_info(self) -> None:
        from service.scheduler.loop import last_plan_info

        info = dataclasses.asdict(last_plan_info())
        try:
            get_redis(self.settings).set(PLAN_INFO_KEY, json.dumps(info, default=str))
        except Exception as exc:
            log.warning("sharing the last plan failed error=%s", exc)

    def _adopt_plan_info(self) -> None:
        from service.scheduler.loop import PlanInfo, last_plan_info, set_last_plan_info

        try:
            raw = get_redis(self.settings).get(PLAN_INFO_KEY)
        except Exception:
            return
        if not raw:
            return
        data = json.loads(raw)
        data["at"] = datetime.fromisoformat(data["at"]) if data.get("at") else None
        mine = last_plan_info().at
        if data["at"] is not None and (mine is None or data["at"] > mine):
            set_last_plan_info(PlanInfo(**data))
