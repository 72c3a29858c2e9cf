"""How a placement reaches this node: popped from the node's RQ queue, claimed at the service
(which answers its spec), its inputs fetched into its folder; then it is ready to start."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Container, Iterator

import redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job

from contract.protocol import PlacementSpec, node_queue_name, placement_job_id
from contract.redis_jobs import delete_job
from worker.config import DaemonConfig
from worker.local_state import LocalPlacement, LocalStatus
from worker.registration import Registration
from worker.runner import INIT_ADAPTER_ARCHIVE
from worker.service_client import Backoff, ServiceClient, ServiceError

log = logging.getLogger("loraplex.worker.daemon")


class Claims:
    """The node queue and the claim: popped -> ready."""

    def __init__(self, cfg: DaemonConfig, client: ServiceClient, conn: redis.Redis,
                 registration: Registration) -> None:
        self.cfg, self.client, self.conn, self.registration = cfg, client, conn, registration

    def pop(self, known: Container[str], max_per_tick: int = 8) -> Iterator[LocalPlacement]:
        """The placements popped from this node's queue, each with its folder and daemon.json;
        those in known are skipped. Stops at an empty queue or a Redis error."""
        node_id = self.registration.node_id
        queue = Queue(node_queue_name(node_id or ""), connection=self.conn)
        for _ in range(max_per_tick):
            try:
                popped = Queue.lpop([queue.key], None, connection=self.conn)
                if popped is None:
                    return
                job_id = popped[1].decode() if isinstance(popped[1], bytes) else popped[1]
                try:
                    job = Job.fetch(job_id, connection=self.conn)
                    placement_id = str(job.args[0])
                except NoSuchJobError:
                    log.warning("queued job vanished node=%s rq_job=%s", node_id, job_id)
                    continue
            except redis.RedisError as exc:
                log.warning("redis unavailable node=%s error=%s", node_id, exc)
                return
            if placement_id in known:
                continue
            directory = self.cfg.work_dir / "placements" / placement_id
            directory.mkdir(parents=True, exist_ok=True)
            p = LocalPlacement(placement_id=placement_id, directory=directory)
            p.save()
            log.info("placement popped node=%s placement=%s", node_id, placement_id)
            yield p

    def claim(self, p: LocalPlacement) -> bool:
        """Claim p (retried with backoff on later calls while the service cannot answer) and
        fetch its inputs; False when the service refused it for good: the caller forgets it."""
        node_id = self.registration.node_id
        if time.monotonic() < p.next_claim_at:
            return True
        try:
            spec = self.client.claim(p.placement_id, node_id or "")
        except ServiceError as exc:
            if exc.retryable:
                p.claim_failures += 1
                p.next_claim_at = time.monotonic() + Backoff().delay(p.claim_failures)
                log.warning("claim deferred node=%s placement=%s error=%s", node_id,
                            p.placement_id, exc)
                return True
            log.warning("claim refused node=%s placement=%s error=%s", node_id,
                        p.placement_id, exc)
            return False
        (p.directory / "spec.json").write_text(spec.model_dump_json(indent=1))
        try:
            self._fetch_inputs(p, spec)
        except ServiceError as exc:
            if exc.retryable:
                p.claim_failures += 1
                p.next_claim_at = time.monotonic() + Backoff().delay(p.claim_failures)
                return True
            p.close_with_failure(spec.task_id, f"could not fetch inputs: {exc}")
            return True
        p.task_id, p.gpu_indices, p.status = spec.task_id, list(spec.gpu_indices), LocalStatus.READY
        p.save()
        self.delete_job(p.placement_id)
        log.info("placement claimed node=%s task=%s placement=%s attempt=%d gpus=%s",
                 node_id, spec.task_id, spec.placement_id, spec.attempt, spec.gpu_indices)
        return True

    def _fetch_inputs(self, p: LocalPlacement, spec: PlacementSpec) -> None:
        """Training/validation files (cached per file id) and the resume checkpoint."""
        cache = self.cfg.work_dir / "files"
        data = p.directory / "data"
        data.mkdir(exist_ok=True)
        for name, file_id, url in (("train.jsonl", spec.training_file_id, spec.training_file_url),
                                   ("validation.jsonl", spec.validation_file_id,
                                    spec.validation_file_url)):
            if file_id is None or url is None:
                continue
            cached = cache / f"{file_id}.jsonl"
            if not cached.exists():
                self.client.download(url, cached)
            shutil.copyfile(cached, data / name)
        self.client.fetch_init_adapter(spec, data / INIT_ADAPTER_ARCHIVE, cache)
        if spec.resume_checkpoint_files:
            resume = p.directory / "resume"
            for url in spec.resume_checkpoint_files:
                target = resume / url.rsplit("/", 1)[-1]
                if not target.exists():
                    self.client.download(url, target)

    def delete_job(self, placement_id: str) -> None:
        """The placement's RQ job, once the placement is claimed or forgotten."""
        try:
            delete_job(self.conn, placement_job_id(placement_id), remove_from_queue=False)
        except redis.RedisError:
            pass
