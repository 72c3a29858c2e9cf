"""A task's data tokenised before its first step (issue 41's load): `trainer.data.tokenize_all` as it
encodes (the fast tokenizer's backend, its encodings read directly) against the tokenizer's call
(which converts every encoding to a dict first), alternated, medians; the examples checked equal.
And DPO pairs (`trainer.pairs.tokenize_pairs`): a batch of records' texts in one backend encoding against a
tokenizer call per record.

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
import trainer.pairs as pairs_mod  # noqa: E402


def alternate(rounds: int, ways: dict[str, tuple]) -> tuple[dict[str, list[float]], dict[str, object]]:
    """Each way (name -> (its `trainer.data._plain_backend`, its run)) timed `rounds` times, the ways
    alternated: the seconds of each and what each made last. A way whose backend pick answers None
    encodes through the tokenizer's call (the product's fallback, what every call did before session 46)."""
    pick = data._plain_backend
    times: dict[str, list[float]] = {k: [] for k in ways}
    made: dict[str, object] = {}
    try:
        for _ in range(rounds):
            for name, (backend, run) in ways.items():
                data._plain_backend = backend
                t0 = time.perf_counter()
                made[name] = run()
                times[name].append(time.perf_counter() - t0)
    finally:
        data._plain_backend = pick
    return times, made


def the_call(tokenizer: object) -> None:
    """No backend: `trainer.data.encode_texts` takes the tokenizer's call."""
    return None


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
    now = data._plain_backend
    times, made = alternate(args.rounds, {
        "backend (now)": (now, lambda: data.tokenize_all(tok, records, 1024)),
        "the call (before)": (the_call, lambda: data.tokenize_all(tok, records, 1024))})
    same = made["backend (now)"] == made["the call (before)"]
    # DPO pairs (trainer.pairs): every record's texts in one backend encoding per 2,048 records (now)
    # against a tokenizer call per record (batch=1 through the call; before session 46 it made one
    # call per text, 2-3 a record, so this baseline is the cheaper of the two)
    prefs = [data.Record(r.messages, rejected=r.messages[-1]["content"][::-1]) for r in records]
    before = "a record a call, through the tokenizer's call"
    pair_times, pairs_made = alternate(args.rounds, {
        "batched (now)": (now, lambda: pairs_mod.tokenize_pairs(tok, prefs, 1024, batch=2048)),
        before: (the_call, lambda: pairs_mod.tokenize_pairs(tok, prefs, 1024, batch=1))})
    same_pairs = pairs_made["batched (now)"] == pairs_made[before]
    lines = [f"# A task's data tokenised ({args.records} records, {os.cpu_count()} CPU cores)", "",
             f"`trainer.data.tokenize_all`, {args.rounds} rounds alternated; the examples equal: **{same}** "
             f"({len(made['backend (now)'])} examples).", ""]
    lines += table(times)
    lines += ["", f"DPO pairs (`trainer.pairs.tokenize_pairs`, the same records with a rejected answer), the pairs "
              f"equal: **{same_pairs}** ({len(pairs_made['batched (now)'])} pairs).", ""]
    lines += table(pair_times)
    te.emit("\n".join(lines) + "\n", {}, args)


def table(times: dict[str, list[float]]) -> list[str]:
    return ["| encoding | median s | min s |", "|---|---|---|"] + [
        f"| {k} | {statistics.median(v):.3f} | {min(v):.3f} |" for k, v in times.items()]


if __name__ == "__main__":
    main()
