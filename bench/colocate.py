"""Co-location (issue 19): a stream of tasks on one base model, trained two ways on one GPU.

  (per-task)  one executor per task, as the service runs them today: each task loads its own
              copy of the backbone when its turn comes (first come, first served on the GPU);
  (shared)    one executor (trainer.executor.Executor) whose first task starts it; every later
              task attaches to it at its arrival time (`attach_task`, from another thread, as the
              daemon would deliver it) and leaves when done.

The stream: `--tasks` tasks of several tenants arriving `--gap-s` apart on average (Poisson,
seeded), mixed sizes: small tasks (1-2 configurations) and searches (4-8 configurations, early exit
with warmup ranking keeping a quarter, so few survive), each with its own data. Reported per mode:
trained samples per GPU-second (every job's steps x batch size over the wall time from the first
arrival to the last completion), mean and p99 task completion time (arrival -> its last job
ended), peak GPU memory (torch.cuda.max_memory_allocated) and backbone tokens per second.

    python bench/colocate.py --out bench/results/colocate_h100.md          # GPU, 8B-wide layers
    python bench/colocate.py --smoke                                        # CPU check, toy sizes

The model is random weights in a Llama-3.1-8B shape with `--layers` decoder layers (speed does not
depend on the values), or `--model-dir` (a local model directory).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contract.protocol import EarlyExitSettings, EvalSettings, TaskSettings  # noqa: E402
from trainer.executor import Callbacks, Executor, ExecutorConfig  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402
from trainer.tiny import _WORDS, train_tokenizer  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class TaskSpec:
    task_id: str
    arrival_s: float
    train_file: Path
    jobs: list[TrainJob]


@dataclass
class Outcome:
    """What one mode measured of one task."""

    arrival_s: float
    end_s: float = math.nan
    samples: int = 0
    states: dict[str, str] = field(default_factory=dict)


def build_model(path: Path, layers: int, smoke: bool) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = train_tokenizer(seed=0)
    shape = (dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2) if smoke else
             dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                  num_key_value_heads=8))
    cfg = LlamaConfig(**shape, num_hidden_layers=layers, max_position_embeddings=8192,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with DEV:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if DEV.type == "cuda" else torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def stream(root: Path, n: int, gap_s: float, seed: int, rows: int, steps: int) -> list[TaskSpec]:
    """n tasks, Poisson arrivals, a third small (1-2 jobs), the rest searches of 4-8 jobs."""
    rng = random.Random(seed)
    tasks, t = [], 0.0
    for i in range(n):
        data = root / f"task{i}.jsonl"
        data.write_text("".join(json.dumps({
            "prompt": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 40))),
            "completion": " " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 60)))}) + "\n"
            for _ in range(rows)))
        n_jobs = rng.randint(1, 2) if i % 3 == 0 else rng.randint(4, 8)
        jobs = [TrainJob(f"t{i}j{k}", lora_rank=rng.choice((8, 16, 32)), lora_alpha=16.0,
                        learning_rate=rng.choice((1e-4, 3e-4, 1e-3, 3e-3)), batch_size=rng.choice((2, 4, 8)),
                        max_steps=rng.randint(steps // 2, steps), seed=k) for k in range(n_jobs)]
        tasks.append(TaskSpec(f"task{i}", t, data, jobs))
        t += rng.expovariate(1.0 / gap_s) if gap_s > 0 else 0.0
    return tasks


def task_cfg(task: TaskSpec, model: Path, out: Path, args: argparse.Namespace) -> ExecutorConfig:
    return ExecutorConfig(
        model_dir=str(model), train_file=str(task.train_file), output_dir=str(out / task.task_id),
        jobs=task.jobs, checkpoint_every=10**6, settings=TaskSettings(
            max_seq_len=args.max_seq_len,
            eval=EvalSettings(eval_every_steps=max(2, args.steps // 4), eval_max_samples=16),
            early_exit=EarlyExitSettings(warmup_fraction=0.1, keep_fraction=0.25)),
        max_tokens_per_step=args.max_tokens_per_step, profile_cache=str(out / "profiles.json"))


def recorder(o: Outcome, t0: float, batch: dict[str, int]) -> Callbacks:
    def on_train_loss(job: str, step: int, loss: float) -> None:
        o.samples += batch[job]

    def on_job_state(job: str, state: str, details: dict) -> None:
        o.states[job] = state
        if state in ("completed", "exited", "failed", "cancelled"):
            o.end_s = time.perf_counter() - t0

    return Callbacks(on_train_loss=on_train_loss, on_job_state=on_job_state)


class Counting(Executor):
    """The executor, counting the real (unpadded) tokens of its backbone passes."""

    tokens = 0  # over every instance of a mode's run

    def _load(self) -> None:
        super()._load()
        step = self.engine.step

        def counted():  # noqa: ANN202
            report = step()
            Counting.tokens += report.tokens
            return report

        self.engine.step = counted


def run_per_task(tasks: list[TaskSpec], model: Path, out: Path, args: argparse.Namespace) -> dict:
    """One executor per task, one after the other on the GPU, each started at max(arrival, free)."""
    outcomes, t0 = {}, time.perf_counter()
    for task in tasks:
        wait = task.arrival_s - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        o = outcomes[task.task_id] = Outcome(task.arrival_s)
        ex = Counting(task_cfg(task, model, out / "per_task", args),
                      recorder(o, t0, {j.job_id: j.batch_size for j in task.jobs}))
        ex.run()
        o.end_s = time.perf_counter() - t0
        del ex
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    return {"wall_s": time.perf_counter() - t0, "tasks": outcomes}


def run_shared(tasks: list[TaskSpec], model: Path, out: Path, args: argparse.Namespace) -> dict:
    """One executor; the first task starts it, the others attach at their arrival."""
    outcomes = {t.task_id: Outcome(t.arrival_s) for t in tasks}
    batch = {j.job_id: j.batch_size for t in tasks for j in t.jobs}
    t0 = time.perf_counter()
    first = tasks[0]
    host = Counting(task_cfg(first, model, out / "shared", args),
                    recorder(outcomes[first.task_id], t0, batch), task_id=first.task_id)

    def deliver() -> None:
        for task in tasks[1:]:
            wait = task.arrival_s - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)
            host.attach_task(task_cfg(task, model, out / "shared", args),
                             recorder(outcomes[task.task_id], t0, batch), task_id=task.task_id)
        host.close()

    feeder = threading.Thread(target=deliver, daemon=True)
    feeder.start()
    res = host.serve()  # until the feeder closes it, after the last arrival
    feeder.join()
    for tid in outcomes:
        assert res[tid]["outcome"] == "succeeded", (tid, res[tid])
    return {"wall_s": time.perf_counter() - t0, "tasks": outcomes}


def summary(mode: str, r: dict, peak: float | None) -> dict:
    done = [o.end_s - o.arrival_s for o in r["tasks"].values()]
    samples = sum(o.samples for o in r["tasks"].values())
    p99 = sorted(done)[max(0, math.ceil(0.99 * len(done)) - 1)]
    return {"mode": mode, "wall_s": r["wall_s"], "samples": samples,
            "samples_per_gpu_s": samples / r["wall_s"], "mean_completion_s": statistics.fmean(done),
            "p99_completion_s": p99, "tokens_per_s": r["tokens"] / r["wall_s"], "peak_gib": None if peak is None else peak / 2**30}


def measure(fn, *a) -> tuple[dict, float | None]:  # noqa: ANN001
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    Counting.tokens = 0
    r = fn(*a)
    r["tokens"] = Counting.tokens
    return r, (torch.cuda.max_memory_allocated() if DEV.type == "cuda" else None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--gap-s", type=float, default=10.0, help="mean seconds between arrivals")
    ap.add_argument("--steps", type=int, default=100, help="most steps of a job")
    ap.add_argument("--rows", type=int, default=300, help="training rows per task")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--max-tokens-per-step", type=int, default=None,
                    help="admission budget in tokens (default on GPU: the measured memory model)")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU: toy model and sizes, checks the script")
    ap.add_argument("--out", type=Path, default=None, help="markdown table (with a JSON twin)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tasks, args.gap_s, args.steps, args.rows, args.layers = 4, 0.5, 12, 40, 2
        args.max_seq_len, args.max_tokens_per_step = 64, args.max_tokens_per_step or 24 * 64
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model_dir or build_model(root / "model", args.layers, args.smoke)
        tasks = stream(root, args.tasks, args.gap_s, args.seed, args.rows, args.steps)
        rows = []
        for mode, fn in (("per-task", run_per_task), ("shared", run_shared)):
            r, peak = measure(fn, tasks, model, root, args)
            rows.append(summary(mode, r, peak))
            print(json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name(0) if DEV.type == "cuda" else "cpu"
    base, shared = rows
    what = (f"Llama-3.1-8B shape, {args.layers} layers" if not (args.smoke or args.model_dir) else
            f"model: {'toy (smoke)' if args.smoke else args.model_dir}")
    lines = [f"# Co-location: {args.tasks} tasks on one base model, one GPU ({device})", "",
             f"{what}; max_seq_len {args.max_seq_len}; mean gap {args.gap_s} s; {args.steps} steps "
             f"at most a job; seed {args.seed}.", "",
             "| mode | wall s | trained samples | samples / GPU-s | backbone tokens / s | mean completion s "
             "| p99 completion s | peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        lines.append(f"| {r['mode']} | {r['wall_s']:.1f} | {r['samples']} | {r['samples_per_gpu_s']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {r['mean_completion_s']:.1f} | {r['p99_completion_s']:.1f} | {peak} |")
    lines += ["", f"shared / per-task samples per GPU-second: "
              f"{shared['samples_per_gpu_s'] / base['samples_per_gpu_s']:.2f}x (target >= 1.5x); "
              f"p99 completion {shared['p99_completion_s']:.1f} s vs {base['p99_completion_s']:.1f} s "
              "(target: no worse)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
