"""Training data for the engine: JSONL parsing (chat with per-message weights and text parts,
prompt/completion, text, DPO in two shapes; tools are ignored), tokenisation with loss masks,
validation split, per-job seeded data order. DPO pairs: trainer.pairs; packing: trainer.packing.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def render_chat(tokenizer: Any, messages: Sequence[dict[str, str]], gen_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=gen_prompt)


def tokenize_record(tokenizer: Any, record: Record, max_seq_len: int) -> Example | None:
    """Token ids with labels only on assistant tokens (of weight 1); truncated to max_seq_len.
    A text record is trained on whole (BOS excepted), with EOS after it.

    With a chat template the assistant spans are found by rendering prefixes of the
    conversation and mapping character spans to tokens; without one, prompt and completion are
    concatenated (user turns as prompt) and EOS ends the completion. None when nothing is trained.
    """
    return tokenize_all(tokenizer, [record], max_seq_len, keep_empty=True)[0]


class _Plan:
    """One record's texts to encode and how its Example is made from their encodings."""

    def __init__(self, tokenizer: Any, record: Record) -> None:
        msgs = record.messages
        self.weights = record.weights or tuple(1 for _ in msgs)
        self.record = record
        self.chat = record.text is None and bool(getattr(tokenizer, "chat_template", None))
        self.spans: list[tuple[int, int]] = []
        if record.text is not None:
            self.texts = [record.text]
        elif self.chat:
            self.texts = [render_chat(tokenizer, msgs, False)]
            for i, m in enumerate(msgs):
                if m["role"] == "assistant" and self.weights[i]:
                    start = len(render_chat(tokenizer, msgs[:i], True)) if i else 0
                    self.spans.append((start, len(render_chat(tokenizer, msgs[: i + 1], False))))
        else:
            self.texts = [m["content"] for m in msgs]

    def example(self, tokenizer: Any, encoded: list[list[int]], offsets: list[list[tuple[int, int]]] | None,
                max_seq_len: int) -> Example | None:
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        if self.record.text is not None:
            ids = list(encoded[0]) + ([eos] if eos is not None else [])
            train = [True] * len(ids)
            if bos is not None:
                ids, train = [bos, *ids], [False, *train]
        elif self.chat:
            assert offsets is not None
            ids = list(encoded[0])
            train = [any(s <= a < e for s, e in self.spans) for a, _ in offsets[0]]
        else:
            ids, train = ([bos], [False]) if bos is not None else ([], [])
            for m, weight, piece in zip(self.record.messages, self.weights, encoded, strict=True):
                is_asst = m["role"] == "assistant"
                piece = [*piece, eos] if is_asst and eos is not None else list(piece)
                ids += piece
                train += [is_asst and bool(weight)] * len(piece)
        ids, train = ids[:max_seq_len], train[:max_seq_len]
        labels = [t if keep else IGNORE for t, keep in zip(ids, train, strict=True)]
        ex = Example(tuple(ids), tuple(labels))
        return ex if ex.n_trained > 0 else None


_ENCODING_METHODS = ("__call__", "_call_one", "_encode_plus", "_batch_encode_plus", "encode_plus", "batch_encode_plus")


def _plain_backend(tokenizer: Any) -> Any:
    """The fast tokenizer's backend where its call would only run it (None: the call it is): a class
    that encodes as transformers' fast tokenizer does, and a backend that neither truncates nor
    pads nor splits special tokens (what the call would set up before encoding)."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or any(
            getattr(cls, m, None) is not getattr(PreTrainedTokenizerFast, m, None) for m in _ENCODING_METHODS):
        return None
    backend = tokenizer.backend_tokenizer
    if (backend.truncation is not None or backend.padding is not None
            or getattr(backend, "encode_special_tokens", False) or getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend


def encode_texts(tokenizer: Any, texts: list[str], offsets: bool) -> tuple[list[list[int]], list | None]:
    """Every text's ids (and character offsets) from ONE tokenizer call: a fast tokenizer encodes a
    batch on all its threads (a record at a time, a 2,000-record file took 1.6 s to tokenise on a
    GPU node, most of the load before a task's first step)."""
    if not texts:
        return [], [] if offsets else None
    backend = _plain_backend(tokenizer)
    if backend is not None:
        # the call below without its conversion of every encoding to a dict (2,000 records, 2 CPU
        # cores: 0.30 s against 0.43 s, bench/results/data_tokenize_cpu.md)
        encodings = backend.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encodings], ([e.offsets for e in encodings] if offsets else None)
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=offsets)
    return enc["input_ids"], (enc["offset_mapping"] if offsets else None)


def encode_each(tokenizer: Any, items: Sequence[Any], offsets: bool) -> Iterator[tuple[list[list[int]], list | None]]:
    """Each item's encoded `texts` (ids, and character offsets where asked), every item's texts
    encoded in one `encode_texts` call."""
    ids, offs = encode_texts(tokenizer, [t for item in items for t in item.texts], offsets)
    at = 0
    for item in items:
        n = len(item.texts)
        yield ids[at : at + n], (offs[at : at + n] if offsets else None)
        at += n


def tokenize_all(tokenizer: Any, records: Iterable[Record], max_seq_len: int, keep_empty: bool = False,
                 batch: int = 4096) -> list[Example]:
    """Tokenise records (tokenize_record's rules), dropping the ones with no trained token left
    after truncation (keep_empty: None in their place). The texts of up to `batch` records are
    encoded in one tokenizer call each."""
    records = list(records)
    out: list[Example | None] = []
    for lo in range(0, len(records), batch):
        plans = [_Plan(tokenizer, r) for r in records[lo : lo + batch]]
        made: list[Example | None] = [None] * len(plans)
        for chat in (False, True):  # chat texts need their character offsets; the others do not
            group = [i for i, p in enumerate(plans) if p.chat == chat]
            for i, (ids, offs) in zip(group, encode_each(tokenizer, [plans[i] for i in group], chat), strict=True):
                made[i] = plans[i].example(tokenizer, ids, offs, max_seq_len)
        out += made
    return out if keep_empty else [ex for ex in out if ex is not None]


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


def sequence_tokens(example: object) -> int:
    """The tokens a training step runs for one batch item: its sequence (no padding); a DPO
    pair: both of its sequences."""
    chosen = getattr(example, "chosen", None)
    if chosen is not None:
        return len(chosen.input_ids) + len(example.rejected.input_ids)
    return len(example.input_ids)
