"""What the worker's spool costs a training step on this machine's disk (issue 40's "speed is what a
user's real search gets"): the executor's callbacks append one spool record per job per step (its
train loss point) through `worker.spool.SpoolWriter.write`, which flushes and fsyncs each line in the
training loop's thread. The benches that drive `trainer.executor.Executor` directly never pay this;
a task that runs through the worker (`worker.runner`) does.

Times `--records` train-loss records through the real SpoolWriter into a spool under each `--dir`
(median and p90 per record, and the whole), and the same records with `os.fsync` made a no-op (the
page cache's part), so the difference is the disk's.

    python bench/spool_fsync.py [--dir /tmp --dir /dev/shm] [--records 400] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker import spool  # noqa: E402


def timed_records(directory: Path, n: int, fsync: bool) -> list[float]:
    work = Path(tempfile.mkdtemp(prefix="spool_fsync_", dir=directory))
    real = os.fsync
    if not fsync:
        spool.os.fsync = lambda fd: None  # the page cache's part alone
    try:
        writer = spool.SpoolWriter(work / spool.SPOOL_NAME)
        took = []
        for i in range(n):
            t0 = time.perf_counter()
            writer.metric(f"job-{i % 8}", i // 8, "train", 2.0 + 1e-3 * i, None, (1500, 0.11))
            took.append(time.perf_counter() - t0)
        return took
    finally:
        spool.os.fsync = real
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", action="append", default=None, help="a folder on the disk to time (repeatable)")
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = ["| folder | fsync | per record median ms | p90 ms | all records s |", "|---|---|---|---|---|"]
    for d in args.dir or [tempfile.gettempdir()]:
        for fsync in (True, False):
            timed_records(Path(d), 20, fsync)  # warm-up: the file system's first allocations
            took = sorted(timed_records(Path(d), args.records, fsync))
            rows.append(f"| {d} | {'yes' if fsync else 'no'} | {statistics.median(took) * 1e3:.3f} | "
                        f"{took[int(0.9 * (len(took) - 1))] * 1e3:.3f} | {sum(took):.3f} |")
    text = "\n".join([f"# Spool records through worker.spool.SpoolWriter ({args.records} train-loss records)", "",
                      *rows, ""])
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
