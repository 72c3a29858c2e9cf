"""DPO preference pairs: a record's prompt with its chosen and its rejected answer tokenised as
SFT tokenises a conversation (labels on the responses only), truncated so both sides fit, and the
content key the reference log-probs are cached under."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from trainer.data import IGNORE, Example, Record, render_chat


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


def _prompt_and_response(tokenizer: Any, prompt: Sequence[dict[str, str]], response: str
                         ) -> tuple[list[int], list[int], list[bool]]:
    """Prompt ids, response ids and which response ids are trained, tokenised as SFT does
    (chat template when the tokenizer has one, else prompt + response + EOS)."""
    msgs = [*prompt, {"role": "assistant", "content": response}]
    if getattr(tokenizer, "chat_template", None):
        start = len(render_chat(tokenizer, prompt, True))
        end = len(render_chat(tokenizer, msgs, False))
        enc = tokenizer(render_chat(tokenizer, msgs, False), add_special_tokens=False,
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
