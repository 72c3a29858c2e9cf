"""How pinning host memory in a background thread slows the training loop's launches, by method
(issue 40: the search's park pool pins ~30 GB after the first step; while it pins, the loop's eager
steps and adapter inits ran 2-4x slower on an H100).

Methods, each pinning --gb GB in chunks of --chunk-mb MB in a background thread:
- alloc: torch.empty(pin_memory=True) (cudaHostAlloc: allocate, zero and lock under the driver);
- register: pageable memory touched first by the thread (no driver), then cudaHostRegister;
- huge: the same on anonymous memory advised MADV_HUGEPAGE (2 MB pages: fewer pages to lock).
For each: seconds to pin, GB/s, and a launch-bound loop's time alone and beside the pinning
(median of its rounds), the loop being --launches small kernels and one sync a round.
A pinned chunk is checked: a non_blocking copy to the device and back gives its bytes.
"""
from __future__ import annotations

import argparse
import json
import mmap
import statistics
import threading
import time

import torch


def _pin_alloc(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def _register(buf: torch.Tensor) -> torch.Tensor:
    buf.fill_(0)  # the pages faulted in by this thread, without the driver
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister: {err}")
    return buf


def _pin_register(size: int) -> torch.Tensor:
    return _register(torch.empty(size, dtype=torch.uint8))


_KEEP: list = []


def _pin_huge(size: int) -> torch.Tensor:
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    _KEEP.append(mm)
    return _register(torch.frombuffer(mm, dtype=torch.uint8))


METHODS = {"alloc": _pin_alloc, "register": _pin_register, "huge": _pin_huge}


def _pin_all(pin, n: int, size: int, chunks: list, took: list, done: threading.Event) -> None:  # noqa: ANN001
    t0 = time.perf_counter()
    for _ in range(n):
        chunks.append(pin(size))
    took.append(time.perf_counter() - t0)
    done.set()


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14: fault the range in, writable


def split_times(n: int, size: int) -> dict[str, dict[str, float]]:
    """Where a chunk's pinning goes (the pool's `_registered_bytes`, on this thread, nothing beside):
    per way of faulting its pages in, the median seconds of the fault and of cudaHostRegister."""
    out: dict[str, dict[str, float]] = {}
    for way in ("huge_fill", "huge_populate", "plain_fill"):
        fault, register = [], []
        for _ in range(n):
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            t0 = time.perf_counter()
            if way.startswith("huge"):
                mm.madvise(mmap.MADV_HUGEPAGE)
            buf = torch.frombuffer(mm, dtype=torch.uint8)
            try:
                if way == "huge_populate":
                    mm.madvise(MADV_POPULATE_WRITE)
                else:
                    buf.fill_(0)
            except OSError as err:
                out[way] = {"error": str(err)}
                break
            t1 = time.perf_counter()
            err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), size, 0)
            t2 = time.perf_counter()
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
            del buf
            mm.close()
            if int(err) != 0:
                out[way] = {"error": f"cudaHostRegister {err}"}
                break
            fault.append(t1 - t0)
            register.append(t2 - t1)
        else:
            out[way] = {"fault_s": statistics.median(fault), "register_s": statistics.median(register)}
        print(f"split {way} ({size >> 20} MB chunks): {out[way]}")
    return out


def loop_round(x: torch.Tensor, launches: int) -> float:
    t0 = time.perf_counter()
    for _ in range(launches):
        x.add_(1.0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=8.0)
    ap.add_argument("--chunk-mb", type=int, default=256)
    ap.add_argument("--launches", type=int, default=2000)
    ap.add_argument("--methods", default="alloc,register,huge")
    ap.add_argument("--json", default=None)
    ap.add_argument("--split", type=int, default=0, help="chunks timed by part first (fault, register)")
    args = ap.parse_args()
    x = torch.zeros(1024, device="cuda")
    for _ in range(5):
        loop_round(x, args.launches)
    alone = statistics.median(loop_round(x, args.launches) for _ in range(20))
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    out = {"device": torch.cuda.get_device_name(), "thp": thp, "loop_alone_s": alone, "methods": {}}
    print(f"THP: {thp}; loop of {args.launches} launches alone: {alone * 1e3:.1f} ms")
    if args.split:
        out["split"] = split_times(args.split, args.chunk_mb << 20)
    for name in args.methods.split(","):
        pin = METHODS[name]
        chunks: list[torch.Tensor] = []
        n = int(args.gb * 1024 / args.chunk_mb)
        done = threading.Event()
        took: list[float] = []

        th = threading.Thread(target=_pin_all, args=(pin, n, args.chunk_mb << 20, chunks, took, done), daemon=True)
        th.start()
        rounds = []
        while not done.is_set():
            rounds.append(loop_round(x, args.launches))
        th.join()
        c = chunks[0]
        c[:4096].copy_(torch.arange(4096, dtype=torch.int64).to(torch.uint8))
        back = c[:4096].to("cuda", non_blocking=True).to("cpu")
        ok = bool(torch.equal(back, c[:4096])) and c.is_pinned()
        beside = statistics.median(rounds) if rounds else float("nan")
        row = {"pin_s": took[0], "gb_per_s": args.gb / took[0], "loop_beside_s": beside,
               "slowdown": beside / alone, "rounds": len(rounds), "pinned_ok": ok}
        out["methods"][name] = row
        print(f"{name}: {args.gb:.0f} GB in {took[0]:.2f} s ({row['gb_per_s']:.2f} GB/s); loop beside it "
              f"{beside * 1e3:.1f} ms ({row['slowdown']:.1f}x, {len(rounds)} rounds); pinned copy ok: {ok}")
        for c in chunks:
            if name != "alloc":
                torch.cuda.cudart().cudaHostUnregister(c.data_ptr())
        chunks.clear()
        _KEEP.clear()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
