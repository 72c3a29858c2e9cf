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


def through_the_call(tokenizer, texts: list[str], offsets: bool):  # noqa: ANN001, ANN201
    """`trainer.data.encode_texts` before session 46: the tokenizer's call."""
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
    ways = {"backend (now)": data.encode_texts, "the call (before)": through_the_call}
    times: dict[str, list[float]] = {k: [] for k in ways}
    made = {}
    for _ in range(args.rounds):
        for name, encode in ways.items():
            data.encode_texts = encode
            t0 = time.perf_counter()
            made[name] = data.tokenize_all(tok, records, 1024)
            times[name].append(time.perf_counter() - t0)
    data.encode_texts = ways["backend (now)"]
    same = made["backend (now)"] == made["the call (before)"]
    # DPO pairs (trainer.pairs): every record's texts in one backend encoding per 2,048 records (now)
    # against a tokenizer call per record (batch=1 through the call; before session 46 it made one
    # call per text, 2-3 a record, so this baseline is the cheaper of the two)
    prefs = [data.Record(r.messages, rejected=r.messages[-1]["content"][::-1]) for r in records]
    before = "a record a call, through the tokenizer's call"
    pair_times: dict[str, list[float]] = {"batched (now)": [], before: []}
    pairs_made = {}
    for _ in range(args.rounds):
        for name, batch, encode in (("batched (now)", 2048, ways["backend (now)"]),
                                    (before, 1, through_the_call)):
            data.encode_texts = encode
            t0 = time.perf_counter()
            pairs_made[name] = pairs_mod.tokenize_pairs(tok, prefs, 1024, batch=batch)
            pair_times[name].append(time.perf_counter() - t0)
    data.encode_texts = ways["backend (now)"]
    same_pairs = pairs_made["batched (now)"] == pairs_made[before]
    lines = [f"# A task's data tokenised ({args.records} records, {os.cpu_count()} CPU cores)", "",
             f"`trainer.data.tokenize_all`, {args.rounds} rounds alternated; the examples equal: **{same}** "
             f"({len(made['backend (now)'])} examples).", "", "| encoding | median s | min s |", "|---|---|---|"]
    lines += [f"| {k} | {statistics.median(v):.3f} | {min(v):.3f} |" for k, v in times.items()]
    lines += ["", f"DPO pairs (`trainer.pairs.tokenize_pairs`, the same records with a rejected answer), the pairs "
              f"equal: **{same_pairs}** ({len(pairs_made['batched (now)'])} pairs).", "",
              "| encoding | median s | min s |", "|---|---|---|"]
    lines += [f"| {k} | {statistics.median(v):.3f} | {min(v):.3f} |" for k, v in pair_times.items()]
    te.emit("\n".join(lines) + "\n", {}, args)


if __name__ == "__main__":
    main()
