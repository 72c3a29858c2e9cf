"""A scripted executor for daemon/service loop tests: speaks the real spool protocol (events,
metric points, job states, checkpoint and adapter artifacts, finish) without training anything.

Run by the daemon as ``python -m tests.e2e.fake_runner --placement-dir DIR``. Behaviour from
the env LORAPLEX_FAKE_MODE: ``ok`` (default), ``hang_first`` (attempt 1 checkpoints at step 2
and then waits to be killed), ``hang`` (waits for SIGTERM, logs it, exits 143), ``slow``
(0.4 s per step), ``stubborn`` (ignores SIGTERM and waits: only SIGKILL ends it).
LORAPLEX_FAKE_STEP_S sets the time per step of the other modes; with LORAPLEX_FAKE_MODE_LINES=N
the mode applies only to tasks whose training file has N lines (the others run ``ok``). The executor_started event
carries where it really ran (the daemon's work dir name, LORAPLEX_SLOTS) and its wall clock
start; executor_done (just before the finish record) its wall clock end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import sys
import time
from pathlib import Path

from contract.protocol import PlacementSpec
from worker.spool import SpoolWriter

STEPS = 6


def tiny_safetensors() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + struct.pack("<2f", 1.0, 2.0)


def write_dir(root: Path, name: str, files: dict[str, bytes]) -> str:
    tmp = root / "artifacts" / f".{name}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    for fname, data in files.items():
        (tmp / fname).write_bytes(data)
    final = root / "artifacts" / name
    os.replace(tmp, final)
    return f"artifacts/{name}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--placement-dir", type=Path, required=True)
    root = ap.parse_args().placement_dir
    spec = PlacementSpec.model_validate_json((root / "spec.json").read_text())
    spool = SpoolWriter(root / "spool.jsonl")
    train = (root / "data" / "train.jsonl").read_text().splitlines()
    mode = os.environ.get("LORAPLEX_FAKE_MODE", "ok")
    only = os.environ.get("LORAPLEX_FAKE_MODE_LINES")
    if only is not None and int(only) != len(train):
        mode = "ok"

    def on_term(signum: int, _frame: object) -> None:
        spool.event("executor_sigterm", "stopping on SIGTERM")
        sys.exit(143)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stubborn" else on_term)
    start = 0
    ckpt = root / "resume" / "state.json"
    if ckpt.exists():
        start = int(json.loads(ckpt.read_text())["step"])
    step_s = 0.4 if mode == "slow" else float(os.environ.get("LORAPLEX_FAKE_STEP_S", "0"))
    spool.event("executor_started", f"attempt {spec.attempt} from step {start}",
                data={"resumed_from_step": start, "attempt": spec.attempt,
                      "train_lines": len(train), "t": time.time(),
                      "work_dir": root.parent.parent.name,  # worker-<node name>
                      "slots": os.environ.get("LORAPLEX_SLOTS"),
                      "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")})
    live = [j for j in spec.jobs if j.state in ("pending", "running")]
    for job in live:
        spool.job_state(job.job_id, state="running")
    if mode in ("hang", "stubborn"):
        while True:
            time.sleep(0.1)
    for step in range(start + 1, STEPS + 1):
        time.sleep(step_s)
        for k, job in enumerate(live):
            spool.metric(job.job_id, step, "train", 3.0 - 0.2 * step + 0.1 * k)
        if step == 2:
            spool.artifact(write_dir(root, "ckpt-2", {"state.json": b'{"step": 2}'}),
                           kind="checkpoint", step=2)
            if mode == "hang_first" and spec.attempt == 1:
                while True:
                    time.sleep(0.1)
    best = None
    for k, job in enumerate(live):
        val = 2.0 + 0.1 * k
        spool.metric(job.job_id, STEPS, "val", val)
        if k % 2 == 1:
            spool.job_state(job.job_id, state="exited", exit_reason="underperforming",
                            last_step=STEPS)
            continue
        config = {"peft_type": "LORA", "r": job.hyperparameters.lora_rank,
                  "lora_alpha": job.hyperparameters.lora_alpha, "target_modules": ["q_proj"],
                  "base_model_name_or_path": spec.base_model}
        spool.artifact(write_dir(root, f"adapter-{job.job_id}", {
            "adapter_config.json": json.dumps(config).encode(),
            "adapter_model.safetensors": tiny_safetensors()}), kind="adapter", job_id=job.job_id)
        spool.job_state(job.job_id, state="completed", best_val_loss=val, best_step=STEPS,
                        last_step=STEPS)
        best = best or job.job_id
    spool.event("executor_done", data={"t": time.time()})
    spool.finished(best_job_id=best, summary={"steps": STEPS})
    return 0


if __name__ == "__main__":
    sys.exit(main())
