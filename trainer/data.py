"""Training data for the engine: JSONL parsing (chat with per-message weights and text parts,
prompt/completion, text, DPO in two shapes; tools are ignored), tokenisation with
loss masks (DPO pairs too), validation split, per-job seeded data order, packing of a step into rows.

Packing: each job's sequences of a step go into rows of one common length, several sequences
per row with position ids restarting at 0 (transformers then builds a block-causal mask); a row
never mixes jobs, so one job's NaN cannot reach another job through attention. The step's
[rows, length] comes from a few buckets (ShapeBuckets), so attention plans are reused.
"""

from __future__ import annotations

import hashlib
import json
import random
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

IGNORE = -100


@dataclass(frozen=True)
class Record:
    """One parsed training example: a conversation (for DPO: the prompt and the chosen answer,
    with the rejected answer beside it), or a plain text trained on whole.

    `weights` (chat): one 0/1 per message; an assistant message of weight 0 is context, not
    trained on. None: every assistant message is trained."""

    messages: tuple[dict[str, str], ...]
    rejected: str | None = None
    weights: tuple[int, ...] | None = None
    text: str | None = None


@dataclass(frozen=True)
class Example:
    """A tokenised example: ids and per-token labels (IGNORE where no loss is taken)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    @property
    def n_trained(self) -> int:
        return sum(1 for t in self.labels[1:] if t != IGNORE)


@dataclass(frozen=True)
class PairExample:
    """A tokenised DPO pair: prompt + chosen and prompt + rejected, labels on the responses."""

    chosen: Example
    rejected: Example

    @cached_property
    def key(self) -> bytes:
        """Content digest: the reference log-probs of a pair depend on its tokens and labels
        only, so they are cached (and checkpointed) under this key."""
        h = hashlib.blake2b(digest_size=16)
        for part in (self.chosen.input_ids, self.chosen.labels, self.rejected.input_ids,
                     self.rejected.labels):
            h.update(len(part).to_bytes(4, "little"))
            h.update(array("q", part).tobytes())
        return h.digest()


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError(f"{where}: content must be a string or a list of text parts")


def _messages(msgs: Any, where: str) -> tuple[list[dict[str, str]], list[int]]:
    """Messages as {role, content} with their weights. Tools are ignored: a `tool` message and
    an assistant message that only calls tools are left out (the service's upload check accepts
    exactly these shapes)."""
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"'{where}' must be a non-empty list")
    out, weights = [], []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"bad message {m!r}")
        if m["role"] == "tool" or (m["role"] == "assistant" and m.get("content") is None
                                   and m.get("tool_calls")):
            continue
        weight = m.get("weight", 1)
        if isinstance(weight, bool) or weight not in (0, 1) or (
                "weight" in m and m["role"] != "assistant"):
            raise ValueError(f"bad weight in message {m!r}: 0 or 1, on assistant messages")
        out.append({"role": m["role"], "content": _text(m.get("content"), where)})
        weights.append(int(weight) if m["role"] == "assistant" else 0)
    return out, weights


def _output(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], dict) \
            or value[0].get("role") != "assistant":
        raise ValueError(f"'{key}' must be a list of one assistant message")
    return _text(value[0].get("content"), key)


def parse_record(obj: dict[str, Any]) -> Record:
    """Parse one JSONL object into a Record: chat `messages` (per-message `weight`, content as
    text parts, tools ignored), `prompt`/`completion`, `text`, and the preference shapes
    `prompt`/`chosen`/`rejected` and `input`/`preferred_output`/`non_preferred_output`."""
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    if "messages" in obj:
        out, weights = _messages(obj["messages"], "messages")
        if not any(m["role"] == "assistant" and w for m, w in zip(out, weights, strict=True)):
            raise ValueError("a chat example needs at least one assistant message with weight 1")
        return Record(tuple(out), weights=None if all(
            w for m, w in zip(out, weights, strict=True) if m["role"] == "assistant"
        ) else tuple(weights))
    if "preferred_output" in obj or "non_preferred_output" in obj or "input" in obj:
        inp = obj.get("input")
        if not isinstance(inp, dict):
            raise ValueError("'input' must be an object with 'messages'")
        prompt, _ = _messages(inp.get("messages"), "input.messages")
        chosen = _output(obj, "preferred_output")
        return Record((*prompt, {"role": "assistant", "content": chosen}),
                      rejected=_output(obj, "non_preferred_output"))
    if "chosen" in obj and "rejected" in obj and "prompt" in obj:
        return Record(
            ({"role": "user", "content": str(obj["prompt"])},
             {"role": "assistant", "content": str(obj["chosen"])}),
            rejected=str(obj["rejected"]),
        )
    if "prompt" in obj and "completion" in obj:
        return Record(
            ({"role": "user", "content": str(obj["prompt"])},
             {"role": "assistant", "content": str(obj["completion"])}),
        )
    if isinstance(obj.get("text"), str) and obj["text"].strip():
        return Record((), text=obj["text"])
    raise ValueError(f"unknown record format with keys {sorted(obj)}")


def read_jsonl(path: str | Path) -> list[Record]:
    """All records of a JSONL file (a UTF-8 BOM and blank lines skipped); errors name the line."""
    records = []
    with open(path, encoding="utf-8-sig") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                records.append(parse_record(json.loads(line)))
            except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{lineno}: {exc}") from exc
    return records


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], gen_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=gen_prompt)


def tokenize_record(tokenizer: Any, record: Record, max_seq_len: int) -> Example | None:
    """Token ids with labels only on assistant tokens (of weight 1); truncated to max_seq_len.
    A text record is trained on whole (BOS excepted), with EOS after it.

    With a chat template the assistant spans are found by rendering prefixes of the
    conversation and mapping character spans to tokens; without one, prompt and completion are
    concatenated (user turns as prompt) and EOS ends the completion. None when nothing is trained.
    """
    msgs = record.messages
    weights = record.weights or tuple(1 for _ in msgs)
    if record.text is not None:
        ids = tokenizer(record.text, add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids = [*ids, tokenizer.eos_token_id]
        train = [True] * len(ids)
        if tokenizer.bos_token_id is not None:
            ids, train = [tokenizer.bos_token_id, *ids], [False, *train]
    elif getattr(tokenizer, "chat_template", None):
        text = _render(tokenizer, msgs, False)
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] == "assistant" and weights[i]:
                start = len(_render(tokenizer, msgs[:i], True)) if i else 0
                end = len(_render(tokenizer, msgs[: i + 1], False))
                spans.append((start, end))
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        train = [any(s <= a < e for s, e in spans) for a, _ in enc["offset_mapping"]]
    else:
        ids, train = [], []
        if tokenizer.bos_token_id is not None:
            ids.append(tokenizer.bos_token_id)
            train.append(False)
        for m, weight in zip(msgs, weights, strict=True):
            piece = tokenizer(m["content"], add_special_tokens=False)["input_ids"]
            is_asst = m["role"] == "assistant"
            if is_asst and tokenizer.eos_token_id is not None:
                piece = [*piece, tokenizer.eos_token_id]
            ids += piece
            train += [is_asst and bool(weight)] * len(piece)
    ids, train = ids[:max_seq_len], train[:max_seq_len]
    labels = [t if keep else IGNORE for t, keep in zip(ids, train, strict=True)]
    ex = Example(tuple(ids), tuple(labels))
    return ex if ex.n_trained > 0 else None


def tokenize_all(tokenizer: Any, records: Iterable[Record], max_seq_len: int) -> list[Example]:
    """Tokenise records, dropping the ones with no trained token left after truncation."""
    out = []
    for r in records:
        ex = tokenize_record(tokenizer, r, max_seq_len)
        if ex is not None:
            out.append(ex)
    return out


def _prompt_and_response(tokenizer: Any, prompt: Sequence[dict[str, str]], response: str
                         ) -> tuple[list[int], list[int], list[bool]]:
    """Prompt ids, response ids and which response ids are trained, tokenised as SFT does
    (chat template when the tokenizer has one, else prompt + response + EOS)."""
    msgs = [*prompt, {"role": "assistant", "content": response}]
    if getattr(tokenizer, "chat_template", None):
        start = len(_render(tokenizer, prompt, True))
        end = len(_render(tokenizer, msgs, False))
        enc = tokenizer(_render(tokenizer, msgs, False), add_special_tokens=False,
                        return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        n_prompt = sum(1 for a, _ in enc["offset_mapping"] if a < start)
        train = [start <= a < end for a, _ in enc["offset_mapping"][n_prompt:]]
        return ids[:n_prompt], ids[n_prompt:], train
    ids: list[int] = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    for m in prompt:
        ids += tokenizer(m["content"], add_special_tokens=False)["input_ids"]
    resp = tokenizer(response, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        resp = [*resp, tokenizer.eos_token_id]
    return ids, resp, [True] * len(resp)


def truncate_pair(prompt_len: int, chosen_len: int, rejected_len: int, max_seq_len: int,
                  prompt_floor: int) -> tuple[int, int, int]:
    """How many prompt tokens (kept from the END) and response tokens (kept from the START) of
    each side stay: the prompt gives way first, down to `prompt_floor` tokens (or its own
    length when shorter), then both responses are cut from the right to fit max_seq_len."""
    longest = max(chosen_len, rejected_len)
    keep_prompt = min(prompt_len, max(prompt_floor, max_seq_len - longest))
    keep_prompt = min(keep_prompt, max_seq_len - 1)  # at least one response token fits
    room = max_seq_len - keep_prompt
    return keep_prompt, min(chosen_len, room), min(rejected_len, room)


def tokenize_pair(tokenizer: Any, record: Record, max_seq_len: int,
                  prompt_floor: int | None = None) -> PairExample | None:
    """Both sequences of a DPO record with labels on the response tokens only, truncated by
    `truncate_pair` (default floor: half of max_seq_len). None when a side trains nothing."""
    if record.rejected is None:
        raise ValueError("a DPO example needs 'prompt', 'chosen' and 'rejected'")
    prompt, chosen = list(record.messages[:-1]), record.messages[-1]["content"]
    p_c, r_c, t_c = _prompt_and_response(tokenizer, prompt, chosen)
    p_r, r_r, t_r = _prompt_and_response(tokenizer, prompt, record.rejected)
    floor = max_seq_len // 2 if prompt_floor is None else prompt_floor
    keep_p, keep_c, keep_r = truncate_pair(max(len(p_c), len(p_r)), len(r_c), len(r_r),
                                           max_seq_len, floor)
    out = []
    for p, r, t, keep_resp in ((p_c, r_c, t_c, keep_c), (p_r, r_r, t_r, keep_r)):
        kept_prompt = p[len(p) - min(keep_p, len(p)):]
        ids = kept_prompt + r[:keep_resp]
        labels = [IGNORE] * len(kept_prompt) + [
            tok if trained else IGNORE for tok, trained in zip(r[:keep_resp], t[:keep_resp], strict=True)]
        ex = Example(tuple(ids), tuple(labels))
        if ex.n_trained == 0:
            return None
        out.append(ex)
    return PairExample(out[0], out[1])


def tokenize_pairs(tokenizer: Any, records: Iterable[Record], max_seq_len: int,
                   prompt_floor: int | None = None) -> list[PairExample]:
    """Tokenise DPO records, dropping pairs with a side that has no trained token left."""
    out = []
    for r in records:
        pair = tokenize_pair(tokenizer, r, max_seq_len, prompt_floor)
        if pair is not None:
            out.append(pair)
    return out


def split_validation(
    examples: Sequence[Example], val_fraction: float = 0.1, seed: int = 0, max_val: int = 256
) -> tuple[list[Example], list[Example]]:
    """Held-out split shared by all jobs of a task (seeded); at least one of each when n >= 2."""
    n = len(examples)
    if n < 2:
        raise ValueError("need at least 2 examples to hold out a validation split")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = min(max_val, n - 1, max(1, round(val_fraction * n)))
    val = sorted(order[:n_val])
    train = sorted(order[n_val:])
    return [examples[i] for i in train], [examples[i] for i in val]


@dataclass
class JobDataStream:
    """One job's data order: a fresh seeded permutation each epoch; the position is resumable.

    Epoch e uses random.Random(seed * 1_000_003 + e).shuffle; batches run across epoch
    boundaries, so every step has exactly `batch_size` examples.
    """

    n: int
    seed: int
    epoch: int = 0
    pos: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def _perm(self) -> list[int]:
        order = list(range(self.n))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_indices(self, batch_size: int) -> list[int]:
        out: list[int] = []
        while len(out) < batch_size:
            if not self._order:
                self._order = self._perm()
            take = min(batch_size - len(out), self.n - self.pos)
            out += self._order[self.pos : self.pos + take]
            self.pos += take
            if self.pos == self.n:
                self.epoch, self.pos, self._order = self.epoch + 1, 0, []
        return out

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["n"] != self.n:
            raise ValueError(f"data stream size changed: {state['n']} != {self.n}")
        self.seed, self.epoch, self.pos, self._order = state["seed"], state["epoch"], state["pos"], []


@dataclass
class PackedBatch:
    """A step's rows: [R, L] ids, position ids, next-token targets; `row_offsets[i]` is job i's
    first row (rows of a job are contiguous, jobs in slot order)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    row_offsets: list[int]
    real_tokens: int
    # [R, L] int64: the step-wide index of the sequence each token belongs to (-1 on padding),
    # sequences numbered job by job in the order given to pack_step (per-sequence sums, DPO)
    seq_index: torch.Tensor | None = None
    # flat (varlen) batches: [1, T] holding every job's sequences one after another; job i's
    # tokens are token_offsets[i]..token_offsets[i + 1] and cu_seqlens bound every sequence
    # (the padding tail included), for an attention that never crosses them
    token_offsets: list[int] | None = None
    cu_seqlens: list[int] | None = None
    # on the device: the keyword arguments the varlen attention reads (bounds, longest)
    varlen: dict[str, Any] | None = None

    @property
    def job_tokens(self) -> list[int]:
        """Each job's first token in the flattened [R * L] order (and the end)."""
        if self.token_offsets is not None:
            return self.token_offsets
        return [r * self.input_ids.shape[1] for r in self.row_offsets]

    @property
    def padded_fraction(self) -> float:
        total = self.input_ids.numel()
        return 0.0 if total == 0 else 1.0 - self.real_tokens / total

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(
            self.input_ids.to(device), self.position_ids.to(device), self.targets.to(device),
            self.row_offsets, self.real_tokens,
            None if self.seq_index is None else self.seq_index.to(device),
            self.token_offsets, self.cu_seqlens,
        )


def _pack_order(lengths: Sequence[int], length: int) -> list[list[int]]:
    # First-fit decreasing of sequence positions into rows of `length`; stable for equal lengths.
    rows: list[list[int]] = []
    room: list[int] = []
    for k_seq in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        n = lengths[k_seq]
        for k, free in enumerate(room):
            if n <= free:
                rows[k].append(k_seq)
                room[k] -= n
                break
        else:
            rows.append([k_seq])
            room.append(length - n)
    return rows


def bucket_up(n: int, per_octave: int) -> int:
    """The smallest size >= n of the form m * 2^e with per_octave <= m < 2 * per_octave (every
    size up to 2 * per_octave is its own bucket): `per_octave` sizes per doubling, so rounding up
    adds less than 1 / per_octave (per_octave a power of two)."""
    step = max(1, (1 << (max(n, 1).bit_length() - 1)) // per_octave)
    return -(-n // step) * step


@dataclass(frozen=True)
class ShapeBuckets:
    """The sizes a packed step's [rows, length] may take, so attention (cuDNN plans are built
    per shape), autotuned kernels and the allocator see few distinct shapes over a run: lengths
    at least `min_length`, `length_per_octave` per doubling; rows `rows_per_octave` per doubling
    (rows of pure padding after the last job's fill a step up). The defaults: on the task_e2e
    study's steps (bench/task_e2e.py --pack-only) 18 training shapes instead of 84, at 39% padded
    cells instead of 35% (the padding is each job's rows padded to the step's length)."""

    length_per_octave: int = 2
    rows_per_octave: int = 8
    min_length: int = 32

    def length(self, n: int) -> int:
        return bucket_up(max(n, self.min_length), self.length_per_octave)

    def rows(self, n: int) -> int:
        return bucket_up(n, self.rows_per_octave)

    def lengths(self, longest: int, max_row_len: int) -> list[int]:
        """Candidate row lengths: the bucket of the longest sequence and the larger buckets up
        to max_row_len."""
        out = [self.length(longest)]
        while True:
            nxt = self.length(out[-1] + 1)
            if nxt > max_row_len:
                return out
            out.append(nxt)


def _choose_shape(job_lengths: Sequence[Sequence[int]], longest: int, multiple_of: int,
                  max_row_len: int, buckets: ShapeBuckets | None, max_cells: int | None,
                  ) -> tuple[int, int, list[list[list[int]]]]:
    """(rows, length, each job's rows) of the packing with the fewest cells (ties: the shorter
    rows, less attention work). Without buckets: the length among a few multiples of the longest
    sequence, rows as packed. With buckets: bucket lengths and rows, at most max_cells cells
    (rows as packed where the row bucket would exceed it; the fewest cells if nothing fits)."""
    if buckets is None:
        lengths = []
        for factor in (1.0, 1.25, 1.5, 2.0, 3.0, 4.0):
            cand = -(-max(longest, int(longest * factor)) // multiple_of) * multiple_of
            if cand > max(lengths[0] if lengths else cand, max_row_len):
                break
            lengths.append(cand)
    else:
        lengths = sorted({-(-n // multiple_of) * multiple_of for n in buckets.lengths(longest, max_row_len)})
    options = []  # (cells, length, rows, layout)
    for length in lengths:
        layout = [_pack_order(lens, length) for lens in job_lengths]
        packed = sum(len(r) for r in layout)
        rows = packed if buckets is None else buckets.rows(packed)
        if max_cells is not None and rows * length > max_cells:
            rows = packed  # the bucket would exceed the memory the step was admitted for
        options.append((rows * length, length, rows, layout))
    fitting = [o for o in options if max_cells is None or o[0] <= max_cells] or options
    _, length, rows, layout = min(fitting, key=lambda o: (o[0], o[1]))
    return rows, length, layout


def pack_step(
    per_job: Sequence[Sequence[Example]], pad_id: int, pack: bool = True, multiple_of: int = 1,
    max_row_len: int = 2048, buckets: ShapeBuckets | None = None, max_cells: int | None = None,
) -> PackedBatch:
    """Pack each job's examples into rows of one common length, several sequences per row (first
    fit decreasing), position ids restarting at 0 for each sequence; the length (and the row
    count) by `_choose_shape`. Rows added to reach a row bucket are pure padding and belong to
    the last job. With pack=False, one sequence per row padded to the longest, positions running
    on through the padding (a plain causal row, the unpacked reference)."""
    lens = [[len(e.input_ids) for e in seqs] for seqs in per_job]
    longest = max((n for job in lens for n in job), default=1)
    if pack:
        n_rows, length, layout = _choose_shape(lens, longest, multiple_of, max_row_len, buckets,
                                               max_cells)
    else:
        length = -(-longest // multiple_of) * multiple_of
        layout = [[[k] for k in range(len(job))] for job in lens]
        n_rows = sum(len(job) for job in lens)
    return _fill(per_job, layout, n_rows, length, pad_id, restart_padding=pack)


def _fill(per_job: Sequence[Sequence[Example]], layout: Sequence[Sequence[Sequence[int]]],
          n_rows: int, length: int, pad_id: int, restart_padding: bool) -> PackedBatch:
    """The batch tensors of a layout (each job's rows of its sequence numbers)."""
    placed: list[tuple[int, Example, int]] = []  # (start cell, sequence, step-wide index)
    fill: list[int] = []
    row_offsets, first, r = [0], 0, 0
    for j, job_rows in enumerate(layout):
        for row in job_rows:
            c = 0
            for k in row:
                ex = per_job[j][k]
                placed.append((r * length + c, ex, first + k))
                c += len(ex.input_ids)
            fill.append(c)
            r += 1
        row_offsets.append(r)
        first += len(per_job[j])
    row_offsets[-1] = n_rows  # rows that fill the row bucket up are the last job's (all padding)
    fill += [0] * (n_rows - r)
    ids, pos, tgt, seq = _write(placed, fill, n_rows, length, pad_id, restart_padding)
    return PackedBatch(ids, pos, tgt, row_offsets, sum(fill), seq)


def pack_flat(per_job: Sequence[Sequence[Example]], pad_id: int, per_octave: int = 16,
              max_cells: int | None = None) -> PackedBatch:
    """Every job's sequences in ONE row [1, T], job after job, for an attention over variable-
    length sequences (cu_seqlens): no padding between sequences and none per job; T is the token
    count rounded up to `per_octave` sizes per doubling (at most max_cells unless the tokens
    alone exceed it), the tail one padding sequence. Jobs are token ranges (token_offsets)."""
    placed: list[tuple[int, Example, int]] = []
    token_offsets, total = [0], 0
    for seqs in per_job:
        for ex in seqs:
            placed.append((total, ex, len(placed)))
            total += len(ex.input_ids)
        token_offsets.append(total)
    length = max(bucket_up(total, per_octave), 1)
    if max_cells is not None and length > max_cells:
        length = max(total, 1)
    token_offsets[-1] = length  # the padding tail is the last job's (nothing trained)
    cu = [start for start, _, _ in placed] + [total] + ([length] if length > total else [])
    ids, pos, tgt, seq = _write(placed, [total], 1, length, pad_id, True)
    return PackedBatch(ids, pos, tgt, [0] * len(per_job) + [1], total, seq, token_offsets, cu)


def _write(placed: Sequence[tuple[int, Example, int]], fill: Sequence[int], n_rows: int,
           length: int, pad_id: int, restart_padding: bool) -> tuple[torch.Tensor, ...]:
    """[rows, length] ids, positions, next-token targets and sequence index, each sequence
    written at its start cell, each row padded after `fill`: slice writes into host arrays (no
    per-token Python work, no parallel tensor ops on the host), viewed as tensors."""
    cells = n_rows * length
    ids = array("q", [pad_id]) * cells
    tgt = array("q", [IGNORE]) * cells
    seq = array("q", [-1]) * cells
    ramp = array("q", range(length))
    pos = ramp * n_rows  # unpacked rows: positions run on through the padding (plain causal)
    if restart_padding:
        # padding forms its own block (positions restart at 0), so it never joins a sequence
        for r, c in enumerate(fill):
            pos[r * length + c : (r + 1) * length] = ramp[: length - c]
    ignore = array("q", [IGNORE])
    for start, ex, k in placed:
        n = len(ex.input_ids)
        ids[start : start + n] = array("q", ex.input_ids)
        # next-token targets inside the sequence only; its last token predicts nothing
        tgt[start : start + n] = array("q", ex.labels[1:]) + ignore
        seq[start : start + n] = array("q", [k]) * n
        pos[start : start + n] = ramp[:n]
    return tuple(torch.frombuffer(a, dtype=torch.int64).view(n_rows, length) if cells else
                 torch.zeros((n_rows, length), dtype=torch.int64) for a in (ids, pos, tgt, seq))
