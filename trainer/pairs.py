"""Preference pairs: a record's prompt with its chosen and its rejected answer tokenised as SFT
tokenises a conversation (labels on the responses only), truncated so both sides fit, the content
key DPO's reference log-probs are cached under, and `PairObjective`, what the pair objectives
(DPO, ORPO) share: a pair per batch item and every sequence's summed response log-prob."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from trainer.data import IGNORE, Example, Record, encode_each, render_chat
from trainer.engine import MultiLoraEngine
from trainer.head import token_losses
from trainer.jobs import JobRun
from trainer.packing import PackedBatch
from trainer.sft import Sft


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


class _Side:
    """One side of a pair, prompt + response, as SFT tokenises a conversation (chat template when
    the tokenizer has one, else prompt + response + EOS): the texts it encodes, then its prompt
    ids, response ids and which response ids are trained (`split`)."""

    def __init__(self, tokenizer: Any, prompt: Sequence[dict[str, str]], response: str) -> None:
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        if self.chat:
            text = render_chat(tokenizer, [*prompt, {"role": "assistant", "content": response}], False)
            self.start, self.end = len(render_chat(tokenizer, prompt, True)), len(text)
            self.texts = [text]
        else:
            self.texts = [*(m["content"] for m in prompt), response]

    def split(self, tokenizer: Any, encoded: list[list[int]], offsets: list | None
              ) -> tuple[list[int], list[int], list[bool]]:
        if self.chat:
            assert offsets is not None
            ids, spans = list(encoded[0]), offsets[0]
            n_prompt = sum(1 for a, _ in spans if a < self.start)
            return ids[:n_prompt], ids[n_prompt:], [self.start <= a < self.end for a, _ in spans[n_prompt:]]
        ids: list[int] = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        for piece in encoded[:-1]:
            ids += piece
        resp = list(encoded[-1]) + ([] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id])
        return ids, resp, [True] * len(resp)


def _sides(record: Record, tokenizer: Any) -> tuple[_Side, _Side]:
    if record.rejected is None:
        raise ValueError("a DPO example needs 'prompt', 'chosen' and 'rejected'")
    prompt = list(record.messages[:-1])
    return _Side(tokenizer, prompt, record.messages[-1]["content"]), _Side(tokenizer, prompt, record.rejected)


def _pair(sides: Sequence[tuple[list[int], list[int], list[bool]]], max_seq_len: int,
          prompt_floor: int | None) -> PairExample | None:
    """The pair from its sides' (prompt ids, response ids, trained) truncated by `truncate_pair`
    (default floor: half of max_seq_len); None when a side trains nothing."""
    (p_c, r_c, _), (p_r, r_r, _) = sides
    floor = max_seq_len // 2 if prompt_floor is None else prompt_floor
    keep_p, keep_c, keep_r = truncate_pair(max(len(p_c), len(p_r)), len(r_c), len(r_r), max_seq_len, floor)
    out = []
    for (p, r, t), keep_resp in zip(sides, (keep_c, keep_r), strict=True):
        kept_prompt = p[len(p) - min(keep_p, len(p)):]
        ids = kept_prompt + r[:keep_resp]
        labels = [IGNORE] * len(kept_prompt) + [
            tok if trained else IGNORE for tok, trained in zip(r[:keep_resp], t[:keep_resp], strict=True)]
        ex = Example(tuple(ids), tuple(labels))
        if ex.n_trained == 0:
            return None
        out.append(ex)
    return PairExample(out[0], out[1])


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
    return tokenize_pairs(tokenizer, [record], max_seq_len, prompt_floor, keep_empty=True)[0]


def tokenize_pairs(tokenizer: Any, records: Iterable[Record], max_seq_len: int,
                   prompt_floor: int | None = None, keep_empty: bool = False, batch: int = 2048
                   ) -> list[PairExample]:
    """Tokenise DPO records (tokenize_pair's rules), dropping pairs with a side that has no
    trained token left (keep_empty: None in their place). The texts of up to `batch` records are
    encoded in one tokenizer call each (trainer.data.encode_each)."""
    records = list(records)
    out: list[PairExample | None] = []
    for lo in range(0, len(records), batch):
        sides = [side for r in records[lo : lo + batch] for side in _sides(r, tokenizer)]
        chat = bool(sides) and sides[0].chat
        split = [side.split(tokenizer, ids, offs)
                 for side, (ids, offs) in zip(sides, encode_each(tokenizer, sides, chat), strict=True)]
        out += [_pair(split[i : i + 2], max_seq_len, prompt_floor) for i in range(0, len(split), 2)]
    return out if keep_empty else [p for p in out if p is not None]


def pair_sequences(pairs: Sequence[PairExample]) -> list[Example]:
    """A job's sequences in a step: every chosen, then every rejected (pair order)."""
    return [p.chosen for p in pairs] + [p.rejected for p in pairs]


class PairObjective(Sft):
    """A batch item is a pair (chosen, rejected); the loss is the subclass's (`pair_numbers`) of
    each job's per-sequence response log-probs and target-token counts, from ONE forward of all
    jobs' chosen and rejected sequences. Every index is found on the host where the batch is
    built, so the device work syncs nothing."""

    sequences_per_item = 2
    packs_back_to_back = False
    graphable = False
    metric_names: tuple[str, ...] = ("loss", "reward_accuracy", "reward_margin")
    eval_metric_names = metric_names

    def tokenize(self, tokenizer: Any, records: Any, max_seq_len: int) -> list:
        return tokenize_pairs(tokenizer, records, max_seq_len)

    def probe_items(self, rows: list[list[int]], max_seq_len: int) -> list:
        # two sequences of max_seq_len tokens, the responses their second halves
        half = max_seq_len // 2
        return [PairExample(Example(tuple(ids), (-100,) * half + tuple(ids[half:])),
                            Example(tuple(ids[::-1]), (-100,) * half + tuple(ids[::-1][half:])))
                for ids in rows]

    def sequence_logps(self, engine: MultiLoraEngine, states: Sequence[JobRun] | None,
                       seqs: Sequence[Sequence[Example]]
                       ) -> tuple[PackedBatch, torch.Tensor, torch.Tensor]:
        """One forward of these sequences (per job; states None: every adapter off): the batch,
        each sequence's summed target log-prob and its number of target tokens (float), all
        sequences in order (job by job)."""
        cpu = engine.pack_batch(seqs)
        index = (cpu.targets.reshape(-1) != IGNORE).nonzero().reshape(-1)
        seq_of = cpu.seq_index.reshape(-1).index_select(0, index)
        n = sum(len(s) for s in seqs)
        counts = torch.bincount(seq_of, minlength=n)
        batch, (index, seq_of, counts) = engine.batch_to_device(cpu, index, seq_of, counts)
        if states is None:
            engine.slots.clear_layout()
        else:
            engine.slots.set_layout(states, cpu.job_tokens)
        hidden = engine.hidden(batch)
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
        targets = batch.targets.reshape(-1).index_select(0, index)
        tok = -token_losses(engine.output_logits, hidden, targets, engine.head_chunk)
        logps = torch.zeros(n, dtype=tok.dtype, device=tok.device).index_add(0, seq_of, tok)
        return batch, logps, counts.to(tok.dtype)

    def pair_numbers(self, engine: MultiLoraEngine, state: JobRun, pairs: Sequence[PairExample],
                     logps: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The job's mean loss over its pairs (differentiable) and the sums over its pairs of
        metric_names [k], from its sequences' log-probs and counts (chosen first)."""
        raise NotImplementedError

    def _per_job(self, engine: MultiLoraEngine, states: Sequence[JobRun],
                 per_job: Sequence[Sequence[PairExample]]) -> tuple[PackedBatch, list, list]:
        batch, logps, counts = self.sequence_logps(engine, states, [pair_sequences(p) for p in per_job])
        sizes = [2 * len(p) for p in per_job]
        return batch, list(logps.split(sizes)), list(counts.split(sizes))

    def losses(self, engine: MultiLoraEngine, states: Sequence[JobRun],
               per_job: Sequence[Sequence[PairExample]]
               ) -> tuple[PackedBatch, list[torch.Tensor], list[torch.Tensor]]:
        batch, logps, counts = self._per_job(engine, states, per_job)
        losses, numbers = [], []
        for s, pairs, lp, n in zip(states, per_job, logps, counts, strict=True):
            loss, sums = self.pair_numbers(engine, s, pairs, lp, n)
            losses.append(loss)
            numbers.append(sums / len(pairs))
        return batch, losses, numbers

    def eval_sums(self, engine: MultiLoraEngine, states: Sequence[JobRun],
                  chunk: Sequence[PairExample]) -> tuple[torch.Tensor, torch.Tensor]:
        _, logps, counts = self._per_job(engine, states, [chunk] * len(states))
        sums = torch.stack([self.pair_numbers(engine, s, chunk, lp, n)[1]
                            for s, lp, n in zip(states, logps, counts, strict=True)])
        return sums, torch.full((len(states),), float(len(chunk)), dtype=torch.float64)
