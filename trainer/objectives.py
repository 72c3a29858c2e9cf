"""The objective, one component the recipe (trainer.executor) holds: what a batch item is, which
engine computes its loss, and the per-task numbers beside the adapters that a checkpoint keeps.
SFT trains on completions; DPO on preference pairs with a frozen reference (trainer.dpo). The
recipe asks the objective and never which one it is; a new objective is one class here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainer.data import Example, tokenize_all
from trainer.dpo import DpoEngine
from trainer.engine import MultiLoraEngine
from trainer.pairs import PairExample, tokenize_pairs


class Sft:
    """Supervised fine-tuning: a batch item is one sequence."""

    name = "sft"
    engine_class: type[MultiLoraEngine] = MultiLoraEngine
    sequences_per_item = 1
    packs_back_to_back = True  # its sequences may share a row (varlen attention)

    def tokenize(self, tokenizer: Any, records: Any, max_seq_len: int) -> list:
        return tokenize_all(tokenizer, records, max_seq_len)

    def probe_items(self, rows: list[list[int]], max_seq_len: int) -> list:
        """Batch items of full length, every token a target (the memory probe's)."""
        return [Example(tuple(ids), tuple(ids)) for ids in rows]

    def forget(self, engine: Any, items: Sequence[Any]) -> None:
        """Drop what the engine cached for these items (nothing, here)."""

    def prepare_validation(self, engine: Any, val: Sequence[Any], chunk: int) -> None:
        """Work every evaluation of this validation set needs once (nothing, here)."""

    def task_state(self, engine: Any, own: Sequence[Any]) -> None:
        """This rank's per-task numbers a checkpoint keeps beside the adapters (none, here)."""
        return None

    def merge_task_states(self, parts: list[Any]) -> Any:
        return None

    def load_task_state(self, engine: Any, state: Any) -> None:
        """Restore what `merge_task_states` produced (nothing, here)."""


class Dpo(Sft):
    """Direct preference optimisation: a batch item is a pair (chosen, rejected), scored against
    the frozen base model's log-probs, cached per pair (DpoEngine's reference)."""

    name = "dpo"
    engine_class = DpoEngine
    sequences_per_item = 2
    packs_back_to_back = False

    def tokenize(self, tokenizer: Any, records: Any, max_seq_len: int) -> list:
        return tokenize_pairs(tokenizer, records, max_seq_len)

    def probe_items(self, rows: list[list[int]], max_seq_len: int) -> list:
        # two sequences of max_seq_len tokens, the responses their second halves
        half = max_seq_len // 2
        return [PairExample(Example(tuple(ids), (-100,) * half + tuple(ids[half:])),
                            Example(tuple(ids[::-1]), (-100,) * half + tuple(ids[::-1][half:])))
                for ids in rows]

    def forget(self, engine: DpoEngine, items: Sequence[PairExample]) -> None:
        engine.forget_reference(items)

    def prepare_validation(self, engine: DpoEngine, val: Sequence[PairExample], chunk: int) -> None:
        # the validation pairs' reference log-probs once, in the evaluation's chunks, so no
        # evaluation needs a pass the other ranks do not make
        for lo in range(0, len(val), chunk):
            engine.ensure_reference(val[lo : lo + chunk])

    def task_state(self, engine: DpoEngine, own: Sequence[PairExample]) -> dict[str, torch.Tensor]:
        """The engine's cached reference numbers of the task's own pairs only."""
        state = engine.reference_state()
        keys = {p.key for p in own}
        keep = torch.tensor([bytes(k) in keys for k in state["keys"].tolist()], dtype=torch.bool)
        return {"keys": state["keys"][keep], "values": state["values"][keep]}

    def merge_task_states(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        # every rank's reference log-probs (2 floats per pair): a resume reuses them
        return {k: torch.cat([p[k] for p in parts]) for k in ("keys", "values")}

    def load_task_state(self, engine: DpoEngine, state: dict[str, torch.Tensor] | None) -> None:
        if state is not None:
            engine.load_reference_state(state)


OBJECTIVES = {o.name: o for o in (Sft(), Dpo())}


def objective_for(method: str) -> Sft:
    """The objective of a task's method; ValueError names the choices."""
    try:
        return OBJECTIVES[method]
    except KeyError:
        raise ValueError(f"unknown method {method!r}; expected one of {sorted(OBJECTIVES)}") from None
