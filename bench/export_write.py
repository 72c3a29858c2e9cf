"""The adapter file of an export, written the old way (safetensors.torch.save_file after a
contiguous CPU copy per tensor, what write_peft did) and the new way (trainer.export.save_safetensors
from the tensors' memory), as the executor's writer thread writes it: a JobAdapter's PEFT views of
one flat tensor (lora_B's transposed), Llama-3-8B's seven projections in 32 layers at the rank that
makes about --mb MB.

Each writer is timed alone, then on a second thread while this one runs a loop standing in for the
training loop: "torch loop" (small in-place torch ops: a launch-bound step, whose every op lets the
GIL go for a moment) and "python loop" (pure Python, which lets it go only when forced to, every
5 ms switch interval: the worst case for a writer that gives the GIL up often). "loop %" is the
loop's rate during the write against its rate alone (near 100%: the writer left the GIL free); the
write's own seconds there show what waiting for the GIL cost it. Median of --reps after one warmup
each; every write goes to a fresh file (deleted after timing). Checks that the two files load to
equal tensors.

    python bench/export_write.py [--mb 300] [--dtype float32] [--dir /dev/shm] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.export import save_safetensors  # noqa: E402
from trainer.multilora import JobAdapter  # noqa: E402

# (in_features, out_features) of Llama-3-8B's LoRA targets; 32 decoder layers
LLAMA3_8B = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024),
             "o_proj": (4096, 4096), "gate_proj": (4096, 14336), "up_proj": (4096, 14336),
             "down_proj": (14336, 4096)}
LAYERS = 32


def old_write(weights: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
    """write_peft's weights file before save_safetensors (dtype None, as the executor calls it)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu", v.dtype).contiguous() for k, v in weights.items()}
    save_file(tensors, str(path), metadata=meta)


def new_write(weights: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
    save_safetensors(weights, path, meta)


def torch_loop(done: threading.Event) -> float:
    """Small torch ops until `done` is set: iterations per second."""
    x = torch.ones(64)
    n, t0 = 0, time.perf_counter()
    while not done.is_set():
        x.mul_(1.0)
        n += 1
    return n / (time.perf_counter() - t0)


def python_loop(done: threading.Event) -> float:
    """Pure Python until `done` is set: iterations per second."""
    n, t0 = 0, time.perf_counter()
    while not done.is_set():
        n += 1
    return n / (time.perf_counter() - t0)


def idle_rate(loop: Callable[[threading.Event], float], seconds: float = 0.3) -> float:
    """The loop's rate with nothing else running (a timer ends it)."""
    done = threading.Event()
    threading.Timer(seconds, done.set).start()
    return loop(done)


def alone(write: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    write()
    return time.perf_counter() - t0


def beside(loop: Callable[[threading.Event], float], write: Callable[[], None]) -> tuple[float, float]:
    """(seconds of the write on a second thread, the loop's rate on this one meanwhile)."""
    done, took = threading.Event(), [0.0]

    def run() -> None:
        took[0] = alone(write)
        done.set()

    th = threading.Thread(target=run)
    th.start()
    rate = loop(done)
    th.join()
    return took[0], rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=300.0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--dir", default=None, help="where the files go (default: the system temp dir)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    per_rank = LAYERS * sum(i + o for i, o in LLAMA3_8B.values()) * dtype.itemsize
    rank = max(1, round(args.mb * 1e6 / per_rank))
    shapes = {f"model.layers.{i}.{m}": s for i in range(LAYERS) for m, s in LLAMA3_8B.items()}
    adapter = JobAdapter(shapes, rank, alpha=2.0 * rank, seed=0, dtype=dtype)
    with torch.no_grad():
        adapter.flat.normal_(generator=torch.Generator().manual_seed(1))
    weights = adapter.peft_state_dict()
    nbytes = sum(v.numel() * v.element_size() for v in weights.values())
    meta = {"format": "pt", "step": "100"}
    loops = {"torch": torch_loop, "python": python_loop}
    for loop in loops.values():  # the interpreter specialises a loop over its first runs (3.11)
        for _ in range(10):
            idle_rate(loop, 0.05)
    idle = {k: statistics.median(idle_rate(loop) for _ in range(3)) for k, loop in loops.items()}

    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        files = {}
        for label, write in (("save_file (old)", old_write), ("save_safetensors (new)", new_write)):
            runs: dict[str, list] = {"alone": [], **{k: [] for k in loops}}
            for rep in range(args.reps + 1):
                for how in runs:
                    path = Path(tmp) / f"{write.__name__}_{how}_{rep}.safetensors"
                    job = lambda w=write, p=path: w(weights, p, meta)  # noqa: E731
                    got = alone(job) if how == "alone" else beside(loops[how], job)
                    if rep == 0:  # the warmup: its file kept for the equality check
                        files[label] = path
                        continue
                    runs[how].append(got)
                    path.unlink()
            row = [label, statistics.median(runs["alone"])]
            for k in loops:
                row += [statistics.median(s for s, _ in runs[k]),
                        100 * statistics.median(r for _, r in runs[k]) / idle[k]]
            rows.append(row)
        from safetensors.torch import load_file

        a, b = (load_file(str(f)) for f in files.values())
        equal = set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)

    where = args.dir or tempfile.gettempdir()
    print(f"{len(weights)} tensors, {nbytes / 1e6:.0f} MB ({args.dtype}, rank {rank}) to {where}; "
          f"median of {args.reps} after a warmup; torch threads {torch.get_num_threads()}\n")
    print("| writer | alone s | alone GB/s | beside torch loop s | loop % | beside python loop s | loop % |")
    print("|---|---|---|---|---|---|---|")
    for label, secs, t_s, t_loop, p_s, p_loop in rows:
        print(f"| {label} | {secs:.3f} | {nbytes / 1e9 / secs:.2f} | {t_s:.3f} | {t_loop:.0f} "
              f"| {p_s:.3f} | {p_loop:.0f} |")
    print(f"\nfiles load to equal tensors: {equal}")
    if not equal:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
