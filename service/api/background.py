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

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from service.cluster import mark_stale_nodes, replan_due, replan_now
from service.core.config import Settings
from service.core.db import session_scope
from service.core.leader import REPLAN_CHANNEL, Leadership
from service.core.registry import ModelRegistry
from service.core.storage import Storage
from service.merged.runner import Merger
from service.queue import get_redis, republish_all
from service.scheduler.replanner import Replanner, register, unregister
from service.tracking.sync import Syncer

log = logging.getLogger("loraplex.background")

PLAN_INFO_KEY = "loraplex:scheduler:last_plan"  # the leader's last PlanInfo, JSON, in Redis


def maintenance_pass(factory: sessionmaker[Session], settings: Settings) -> None:
    """Nodes silent for node_timeout_s go down (their tasks are requeued), and published
    placements missing from Redis are queued again."""
    with session_scope(factory) as session:
        mark_stale_nodes(session, settings)
        republish_all(session, settings)


class Maintenance:
    """The leader's maintenance thread: a pass every maintenance_interval_s."""

    def __init__(self, factory: sessionmaker[Session], settings: Settings) -> None:
        self._factory, self._settings = factory, settings
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="loraplex-maintenance",
                                        daemon=True)

    def start(self) -> Maintenance:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        while not self._stop.wait(self._settings.maintenance_interval_s):
            try:
                maintenance_pass(self._factory, self._settings)
            except Exception:
                log.exception("maintenance pass failed")


class Background:
    """One API process's part: start() in the app's lifespan, stop() at its end."""

    def __init__(self, factory: sessionmaker[Session], settings: Settings,
                 storage: Storage | None = None, registry: ModelRegistry | None = None) -> None:
        self._factory, self.settings = factory, settings
        self._storage, self._registry = storage, registry
        self._maintenance: Maintenance | None = None
        self._merger: Merger | None = None
        self._syncer: Syncer | None = None
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
        with self._lock:
            if self.settings.maintenance_interval_s > 0:
                self._maintenance = Maintenance(self._factory, self.settings).start()
            if (self.settings.merge_poll_s > 0 and self._storage is not None
                    and self._registry is not None):
                self._merger = Merger(self._factory, self.settings, self._storage,
                                      self._registry).start()
            if self.settings.tracking_poll_s > 0:
                self._syncer = Syncer(self._factory, self.settings).start()
        if self.replanner is not None:
            self.replanner.trigger("leader_elected")  # publish what became due while none led

    def _deposed(self) -> None:
        with self._lock:
            maintenance, self._maintenance = self._maintenance, None
            merger, self._merger = self._merger, None
            syncer, self._syncer = self._syncer, None
        for loop in (maintenance, merger, syncer):
            if loop is not None:
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
