"""SFT, the objective every other one builds on: a batch item is one sequence, its loss the mean
token NLL over its target tokens (the engine's token mean, the loss its step graphs replay), and
nothing cached beside the adapters. The parts an objective gives the recipe and the engine are
named here (trainer.objectives registers each method's; docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainer.data import Example, tokenize_all
from trainer.engine import MultiLoraEngine
from trainer.jobs import JobRun
from trainer.packing import PackedBatch


class Sft:
    """Supervised fine-tuning: a batch item is one sequence."""

    name = "sft"
    sequences_per_item = 1
    packs_back_to_back = True  # its sequences may share a row (varlen attention)
    graphable = True  # its loss is the token mean the step graphs replay (trainer.step_graphs)
    metric_names: tuple[str, ...] = ("loss",)
    eval_metric_names: tuple[str, ...] = ("loss", "token_accuracy")

    def engine_class(self, *args: Any, **kwargs: Any) -> MultiLoraEngine:
        """The engine the recipe builds (MultiLoraEngine's arguments), this objective its loss."""
        return MultiLoraEngine(*args, objective=self, **kwargs)

    # ----- data: what a batch item is -------------------------------------------------------
    def tokenize(self, tokenizer: Any, records: Any, max_seq_len: int) -> list:
        return tokenize_all(tokenizer, records, max_seq_len)

    def probe_items(self, rows: list[list[int]], max_seq_len: int) -> list:
        """Batch items of full length, every token a target (the memory probe's)."""
        return [Example(tuple(ids), tuple(ids)) for ids in rows]

    # ----- the loss, as the engine's step and evaluation call it (engine.StepObjective) -------
    def prepare(self, engine: MultiLoraEngine, per_job: Sequence[Sequence[Any]]) -> None:
        """Work before the step's forward (nothing, here)."""

    def losses(self, engine: MultiLoraEngine, states: Sequence[JobRun],
               per_job: Sequence[Sequence[Example]]
               ) -> tuple[PackedBatch, list[torch.Tensor], list[torch.Tensor]]:
        """The batch, each job's differentiable loss and its detached numbers (metric_names)."""
        return engine.token_mean_losses(states, per_job)

    def eval_sums(self, engine: MultiLoraEngine, states: Sequence[JobRun],
                  chunk: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per job the sums of eval_metric_names [N, k] on the chunk and their counts [N]."""
        return engine.evaluation.token_sums(states, chunk)

    # ----- per-task numbers beside the adapters ---------------------------------------------
    def forget(self, engine: MultiLoraEngine, items: Sequence[Any]) -> None:
        """Drop what the objective cached for these items (nothing, here)."""

    def prepare_validation(self, engine: MultiLoraEngine, val: Sequence[Any], chunk: int) -> None:
        """Work every evaluation of this validation set needs once (nothing, here)."""

    def task_state(self, engine: MultiLoraEngine, own: Sequence[Any]) -> Any:
        """This rank's per-task numbers a checkpoint keeps beside the adapters (none, here)."""
        return None

    def merge_task_states(self, parts: list[Any]) -> Any:
        return None

    def load_task_state(self, engine: MultiLoraEngine, state: Any) -> None:
        """Restore what `merge_task_states` produced (nothing, here)."""
