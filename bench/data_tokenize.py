"""A task's data tokenised before its first step (issue 41's load): `trainer.data.tokenize_all` as it
encodes (the fast tokenizer's backend, its encodings read directly) against the tokenizer's call
(which converts every encoding to a dict first), alternated, medians; the examples checked equal.

The data and tokenizer are bench/executor_task.py's (prompt/completion records of 24-200 and 24-700
words, a word-level tokenizer trained locally).

    python bench/data_tokenize.py [--records 2000] [--rounds 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import executor_task as et  # noqa: E402
import task_e2e_data as te  # noqa: E402

import trainer.data as data  # noqa: E402


def through_the_call(tokenizer, texts: list[str], offsets: bool):  # noqa: ANN001, ANN201
    """`trainer.data._encode` before session 46: the tokenizer's call."""
    if not texts:
        return [], [] if offsets else None
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=offsets)
    return enc["input_ids"], (enc["offset_mapping"] if offsets else None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--work", default="/tmp/data_tokenize")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    root = Path(args.work)
    root.mkdir(parents=True, exist_ok=True)
    tok = te.make_tokenizer()
    records = data.read_jsonl(et.write_data(root / "train.jsonl", args.records, 1))
    ways = {"backend (now)": data._encode, "the call (before)": through_the_call}
    times: dict[str, list[float]] = {k: [] for k in ways}
    made = {}
    for _ in range(args.rounds):
        for name, encode in ways.items():
            data._encode = encode
            t0 = time.perf_counter()
            made[name] = data.tokenize_all(tok, records, 1024)
            times[name].append(time.perf_counter() - t0)
    data._encode = ways["backend (now)"]
    same = made["backend (now)"] == made["the call (before)"]
    lines = [f"# A task's data tokenised ({args.records} records, {os.cpu_count()} CPU cores)", "",
             f"`trainer.data.tokenize_all`, {args.rounds} rounds alternated; the examples equal: **{same}** "
             f"({len(made['backend (now)'])} examples).", "", "| encoding | median s | min s |", "|---|---|---|"]
    lines += [f"| {k} | {statistics.median(v):.3f} | {min(v):.3f} |" for k, v in times.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
