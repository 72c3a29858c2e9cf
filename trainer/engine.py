"""The multi-job training engine: one frozen backbone, many LoRA jobs attached into slots, one
forward and one backward per step over all active jobs' micro-batches, per-job loss and AdamW.

Isolation: no attention crosses a job's sequences (rows: a job's rows hold only its own sequences; varlen:
attention by sequence bounds), every loss is computed on the job's own tokens, a non-finite loss counts zero in
the backward objective (only its own job's gradients turn non-finite), and a job whose loss or gradient norm is
non-finite skips its own update; the other jobs are untouched (bit for bit).

Memory: attached jobs' weights live in one arena and their gradients in one float32 gradient arena of the same
layout, which the kernels address by per-job offsets: `engine.slots` (trainer.arena.AdapterArena). A step costs
one host-to-device copy of the batch and layout, one device sync (the report's numbers), and every job's norm,
clip and AdamW in a few multi-tensor kernels. Held-out evaluation: `engine.evaluation` (trainer.evaluation).
The engine keeps the calls its users make (`jobs`, `attach`, `detach`, `evaluate_metrics`, `evaluate`).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from contract.families import family_of, resolve_targets
from trainer import graph_ahead
from trainer.arena import AdapterArena, host_to_device
from trainer.data import IGNORE, Example, sequence_tokens
from trainer.evaluation import TOKEN_METRICS, Evaluation
from trainer.fused_blocks import fuse_blocks, set_mlp_rebuild
from trainer.head import ModelHead, default_chunk, token_losses, token_losses_and_hits
from trainer.jobs import JobRun, TrainJob
from trainer.multilora import inject_multilora, without_backbone_dropout
from trainer.packing import PackedBatch, ShapeBuckets, pack_flat, pack_step
from trainer.step_graphs import StepGraphs
from trainer.step_passes import StepTotals, forward_backward_passes
from trainer.step_pipeline import StepPipeline
from trainer.step_update import sync_and_update
from trainer.varlen import register_varlen


@dataclass
class StepReport:
    """Outcome of one engine step: per-job train loss, whether its update was skipped, grad norm."""

    losses: dict[str, float]
    skipped: dict[str, bool]
    grad_norms: dict[str, float]
    lrs: dict[str, float]
    tokens: int
    padded_fraction: float
    steps: dict[str, int] = field(default_factory=dict)
    # extra per-job numbers of the step beside the loss (DPO: reward accuracy and margin)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    # each job's exact sequence tokens of the step (sequence_tokens of its micro-batch): its usage
    job_tokens: dict[str, int] = field(default_factory=dict)
    # a step run as several forward-backward passes (engine.split_for): each pass's cells (rows x
    # length; the largest sets the step's peak); None: one pass
    pass_cells: list[int] | None = None


class StepObjective(Protocol):
    """The loss of a step, as the engine calls it (trainer.objectives: SFT, DPO, ORPO). Inside a
    CUDA-graph capture, no part may sync the host; `graphable`: the step graphs' token-mean
    loss is this objective's (trainer.step_graphs)."""

    graphable: bool
    metric_names: tuple[str, ...]  # the step's numbers per job, the loss first
    eval_metric_names: tuple[str, ...]  # evaluation's, the loss first

    def prepare(self, engine: MultiLoraEngine, per_job: Sequence[Sequence]) -> None: ...

    def losses(self, engine: MultiLoraEngine, states: Sequence[JobRun], per_job: Sequence[Sequence]
               ) -> tuple[PackedBatch, list[torch.Tensor], list[torch.Tensor]]: ...

    def eval_sums(self, engine: MultiLoraEngine, states: Sequence[JobRun], chunk: Sequence
                  ) -> tuple[torch.Tensor, torch.Tensor]: ...


class MultiLoraEngine:
    """A frozen causal LM with multi-LoRA layers and the jobs currently attached to it."""

    def __init__(
        self,
        model: nn.Module,
        train_examples: Sequence[Example],
        pad_id: int,
        targets: Sequence[str] | None = None,
        gradient_checkpointing: bool = True,
        backend: str = "auto",
        adapter_dtype: torch.dtype = torch.float32,
        pack: bool = True, pad_multiple: int = 1,
        shape_buckets: ShapeBuckets | None = ShapeBuckets(),  # noqa: B008 (frozen)
        attention: str = "rows",
        step_graphs: bool | None = None,
        objective: StepObjective | None = None,
    ) -> None:
        self.model = model
        self.objective = objective  # the step's loss; None: the token mean (SFT's)
        self.device = next(model.parameters()).device
        self.compute_dtype = next(model.parameters()).dtype
        # the family table: which linears exist, which to adapt by default, how the model
        # scores its tokens (its own output head: the engine's loss is the model's loss)
        self.family = family_of(getattr(model.config, "model_type", None))
        self.targets = resolve_targets(self.family, targets)
        cap = self.family.logit_softcap_attr
        self.logit_softcap: float | None = getattr(model.config, cap, None) if cap else None
        self.output_logits = ModelHead(self)  # the model's own logits (trainer.head)
        without_backbone_dropout(model)
        if (getattr(model.config, "attn_logit_softcapping", None)
                and model.config._attn_implementation == "sdpa"):
            # transformers' SDPA attention has no soft-cap (transformers 5.17 drops Gemma-2's
            # silently; newer ones refuse it): the model's own attention is its eager one
            model.set_attn_implementation("eager")
        self.fused_blocks = fuse_blocks(model)  # the norms' and MLPs' fused kernels (on the GPU)
        self.layers = inject_multilora(model, self.targets)
        self.layer_list = list(self.layers.values())
        self.shapes = {n: (m.in_features, m.out_features) for n, m in self.layers.items()}
        self.train_examples = list(train_examples)
        self.pad_id, self.adapter_dtype, self.pack, self.pad_multiple = pad_id, adapter_dtype, pack, pad_multiple
        # packed steps take their [rows, length] from these buckets (None: free shapes); a step
        # never holds more cells than its sequences at the longest length seen, which is what
        # admission sized it for (sequences x max_seq_len)
        self.shape_buckets = shape_buckets
        # "rows": each job's sequences in its own rows, the model's attention with a block mask;
        # "varlen": every sequence one after another in one row, attention by sequence bounds
        # (trainer.varlen: no padding, no mask, one job's values never reach another's)
        self.attention = "rows"
        self.set_attention(attention)
        self.seq_cap = max((self._longest(e) for e in self.train_examples), default=1)
        self.eval_cap = self.seq_cap  # the evaluations' own (`cap_for`)
        # backbone forwards by (rows, length, with grad): attention plans are built per shape
        self.forward_shapes: Counter[tuple[int, int, bool]] = Counter()
        # the attached jobs, in slot order, and their arenas
        self.slots = AdapterArena(self.layer_list, self.device, adapter_dtype, self.compute_dtype, backend)
        self.gradient_checkpointing = not gradient_checkpointing  # so the first set_recompute sets it all
        self.set_recompute(gradient_checkpointing)
        model.train()
        self.head_chunk = default_chunk(getattr(model.config, "vocab_size", 0) or 32000)
        # adapter parallelism sets this to an all-reduce (max over ranks) of a local count, to
        # agree on extra backbone passes; None: this engine runs alone (see `lockstep`)
        self.agree: Callable[[int], int] | None = None
        self.evaluation = Evaluation(self)  # the held-out evaluation
        # the training step's forward and backward as CUDA graphs per shape (trainer.step_graphs:
        # SFT on the varlen packing, one GPU); None: on where CUDA graphs exist
        use = StepGraphs.use_cuda_graphs(self.device) if step_graphs is None else step_graphs
        self.step_graphs: StepGraphs | None = StepGraphs(self) if use else None
        self.pipeline = StepPipeline(self)  # a graphed step launched before the last one's sync (trainer.step_pipeline)

    # a step's tokens (keyword `padding`: the row's allowance over them) -> recompute on (None: stays)
    recompute_for: Callable[..., bool | None] | None = None
    # each job's tokens of a step -> the jobs (their indices) of each forward-backward pass when the
    # step runs as several passes without recompute rather than one with it (None: one pass)
    split_for: Callable[[list[int]], list[list[int]] | None] | None = None

    def set_recompute(self, on: bool) -> None:
        """Activation recompute (the model's gradient checkpointing) on or off for the next steps: on keeps
        each layer's input alone and repeats its forward in the backward; off keeps every activation."""
        on = bool(on)
        if on == self.gradient_checkpointing:
            return
        self.slots.settle()  # a step capture under way on a thread reads the layers' setting
        if on:
            # no RNG state stashed per layer: the backbone has no dropout (without_backbone_dropout),
            # and reading the CUDA generator's state is not allowed inside a graph capture
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": False})
        else:
            self.model.gradient_checkpointing_disable()
        set_mlp_rebuild(self.model, not on)  # trainer.fused_blocks.MLP_REBUILD
        self.gradient_checkpointing = on

    # ----- jobs: their state, their slots (self.slots) -----------------------------------
    @property
    def jobs(self) -> dict[str, JobRun]:
        """The attached jobs in slot order."""
        return self.slots.jobs

    @property
    def params_per_rank(self) -> int:
        """Adapter parameters a job has per unit of rank (every target's A and B)."""
        return sum(d_in + d_out for d_in, d_out in self.shapes.values())

    def new_job(self, spec: TrainJob) -> JobRun:
        """Create a job's fresh state (adapter init, optimizer, data order) without attaching it."""
        return JobRun.new(spec, self.shapes, self.adapter_dtype, self.device, len(self.train_examples))

    def attach(self, job: TrainJob | JobRun) -> JobRun:
        """Put a job into a slot (new from a spec, or a parked/restored state); no rebuild."""
        return self.slots.attach(self.new_job(job) if isinstance(job, TrainJob) else job.to(self.device))

    def detach(self, job_id: str, park_device: torch.device | str | None = None) -> JobRun:
        """Free a job's slot; with park_device its state moves there (e.g. 'cpu')."""
        return self.slots.detach(job_id, park_device)

    def move_to(self, device: torch.device) -> None:
        """The engine's device is `device` (its backbone was moved or sharded there): the arenas,
        empty (no job attached yet), start again there."""
        self.device = device
        self.slots.reset(device)

    # ----- one step: the batch and the forward -----------------------------------------
    def set_attention(self, mode: str) -> None:
        """Switch the packing and the model's attention between "rows" and "varlen"."""
        if mode not in ("rows", "varlen"):
            raise ValueError(f"attention must be 'rows' or 'varlen', got {mode!r}")
        if mode == "varlen" and self.attention != "varlen":
            self._row_attention = self.model.config._attn_implementation
            self.model.set_attn_implementation(register_varlen())
        elif mode == "rows" and self.attention == "varlen":
            self.model.set_attn_implementation(self._row_attention)
        self.attention = mode

    @staticmethod
    def _longest(example: Example | object) -> int:
        parts = [getattr(example, "chosen", None), getattr(example, "rejected", None)]
        return max((len(e.input_ids) for e in parts if e is not None),
                   default=len(getattr(example, "input_ids", ())))

    def pack_batch(self, per_job: Sequence[Sequence[Example]]) -> PackedBatch:
        """A step's or an evaluation's sequences packed (on the host) into a bucketed shape, at most
        as many cells as its sequences at the longest length seen (what admission planned for)."""
        cap = self.grow_cap(self.model.training, max((len(e.input_ids) for seqs in per_job for e in seqs), default=1))
        n_seqs = sum(len(seqs) for seqs in per_job)
        if self.attention == "varlen":
            return pack_flat(per_job, self.pad_id, max_cells=n_seqs * cap)
        return pack_step(per_job, self.pad_id, pack=self.pack, multiple_of=self.pad_multiple,
                         buckets=self.shape_buckets, max_cells=n_seqs * cap)

    def cap_for(self, train: bool) -> int:
        """The longest sequence so far of the training steps (`seq_cap`) or of the evaluations (at least the steps':
        session 55's held-out sequences had grown the steps' own and moved their keys). `grow_cap` grows it."""
        return self.seq_cap if train else max(self.seq_cap, self.eval_cap)

    def grow_cap(self, train: bool, longest: int) -> int:
        cap = max(self.cap_for(train), longest)
        setattr(self, "seq_cap" if train else "eval_cap", cap)
        return cap

    def batch_to_device(self, cpu: PackedBatch, *extra: torch.Tensor) -> tuple[PackedBatch, list[torch.Tensor]]:
        """The batch (and extra int64 host tensors) on the device in ONE asynchronous copy."""
        cu = [] if cpu.cu_seqlens is None else [torch.tensor(cpu.cu_seqlens, dtype=torch.int64)]
        parts = [cpu.input_ids, cpu.position_ids, cpu.targets, cpu.seq_index, *cu, *extra]
        flat = host_to_device(torch.cat([t.reshape(-1) for t in parts]), self.device)
        out = list(flat.split([t.numel() for t in parts]))
        views = [o.view(t.shape) for o, t in zip(out, parts, strict=True)]
        batch = PackedBatch(views[0], views[1], views[2], cpu.row_offsets, cpu.real_tokens, views[3],
                            cpu.token_offsets, cpu.cu_seqlens)
        if cu:
            # what the varlen attention reads: sequence bounds on the device and the longest
            batch.varlen = {"cu_seq_lens_q": views[4].to(torch.int32), "max_length_q":
                            max(b - a for a, b in zip(cpu.cu_seqlens[:-1], cpu.cu_seqlens[1:], strict=True))}
        return batch, views[4 + len(cu):]

    def hidden(self, batch: PackedBatch) -> torch.Tensor:
        """The backbone's last hidden states of a batch on the device (with the current layout)."""
        self.forward_shapes[(*batch.input_ids.shape, torch.is_grad_enabled())] += 1
        varlen = batch.varlen or {}
        if varlen:
            varlen = {**varlen, "cu_seq_lens_k": varlen["cu_seq_lens_q"], "max_length_k": varlen["max_length_q"]}
        out = self.model.base_model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **varlen
        )
        return out.last_hidden_state

    def _forward_losses(self, states: Sequence[JobRun], per_job: Sequence[Sequence[Example]]):  # noqa: ANN202
        """One forward of every job's micro-batch: the batch, each job's summed token loss and its number of target
        tokens. The head and cross-entropy run once for all jobs' target tokens (trainer.head), then sum per job."""
        batch, losses, _, counts = self.forward_tokens(states, per_job)
        return batch, [part.sum() for part in losses.split(counts)], counts

    def forward_tokens(self, states: Sequence[JobRun], per_job: Sequence[Sequence[Example]], hits: bool = False
                       ) -> tuple[PackedBatch, torch.Tensor, torch.Tensor | None, list[int]]:
        """_forward_losses' forward: the batch, the losses of all jobs' target tokens (in job
        order), with `hits` (no grad) whether each token's argmax is its target (else None), and
        each job's number of target tokens."""
        cpu = self.pack_batch(per_job)
        # every job's target positions found on the host (where the batch was built), moved with
        # the batch in one copy: selecting them on the device then needs no sync
        flat = cpu.targets.reshape(-1)
        index = (flat != IGNORE).nonzero().reshape(-1)
        bounds = cpu.job_tokens
        counts = torch.searchsorted(index, torch.tensor(bounds, dtype=index.dtype)).diff().tolist()
        batch, (index,) = self.batch_to_device(cpu, index)
        self.slots.set_layout(states, bounds)
        hidden = self.hidden(batch)
        if hits:  # an evaluation's forward: its backbone queued (Evaluation.offer_ahead)
            self.evaluation.offer_ahead()
        hidden = hidden.reshape(-1, hidden.shape[-1])
        targets = batch.targets.reshape(-1)
        h, t = hidden.index_select(0, index), targets.index_select(0, index)
        if hits:
            losses, correct = token_losses_and_hits(self.output_logits, h, t, self.head_chunk)
            return batch, losses, correct, counts
        return batch, token_losses(self.output_logits, h, t, self.head_chunk), None, counts

    # ----- one step: the objective's parts (its component, self.objective, computes them) ------
    def _prepare(self, per_job: Sequence[Sequence[Example]]) -> None:
        """Work before the step's forward (DPO: reference log-probs); SFT needs none."""
        if self.objective is not None:
            self.objective.prepare(self, per_job)

    def _losses(self, states: Sequence[JobRun], per_job: Sequence[Sequence[Example]]
                ) -> tuple[PackedBatch, list[torch.Tensor], list[torch.Tensor]]:
        """One forward of every job's micro-batch: the batch, each job's differentiable mean loss
        and each job's detached numbers [loss, *extra metrics] (SFT: just the loss)."""
        if self.objective is not None:
            return self.objective.losses(self, states, per_job)
        return self.token_mean_losses(states, per_job)

    def token_mean_losses(self, states: Sequence[JobRun], per_job: Sequence[Sequence[Example]]
                          ) -> tuple[PackedBatch, list[torch.Tensor], list[torch.Tensor]]:
        """_losses of the token mean over each job's target tokens (SFT's loss)."""
        batch, sums, counts = self._forward_losses(states, per_job)
        losses = [s / max(n, 1) for s, n in zip(sums, counts, strict=True)]
        return batch, losses, [loss.detach().reshape(1) for loss in losses]

    @property
    def metric_names(self) -> tuple[str, ...]:
        return ("loss",) if self.objective is None else self.objective.metric_names

    @property
    def plain_objective(self) -> bool:
        """The token mean (SFT's), which the step graphs replay: no objective or a graphable one,
        and no subclass changes the step's parts."""
        cls = type(self)
        return ((self.objective is None or self.objective.graphable)
                and cls._losses is MultiLoraEngine._losses and cls._prepare is MultiLoraEngine._prepare)

    def _eager_forward_backward(self, states: Sequence[JobRun], per_job: Sequence[Sequence[Example]]
                                ) -> tuple[PackedBatch, list[torch.Tensor]]:
        self._prepare(per_job)
        try:
            batch, losses, numbers = self._losses(states, per_job)
            # a non-finite loss is left out of the objective on the device (no sync before the
            # backward): zero in the sum, so its job alone gets non-finite gradients (its rows
            # and its arena region) and skips its update below
            kept = [torch.where(torch.isfinite(loss), loss, torch.zeros_like(loss)) for loss in losses]
            torch.stack(kept).sum().backward()
        finally:
            self.slots.clear_layout()
        return batch, numbers

    def step(self) -> StepReport:
        """One training step of every attached job that has steps left: one forward and one backward over all
        their micro-batches, then every job's own update; one device sync (the report's numbers). The backward
        runs even when every loss is non-finite (in lockstep the other ranks' all-gathers wait for it). A graphed
        step may have been launched during the one before, and may launch the next (trainer.step_pipeline)."""
        states = [s for s in self.jobs.values() if not s.done]
        if not states:
            raise RuntimeError("no attached job has steps left")
        pipe = self.pipeline if self.step_graphs is not None and self.step_graphs.serves(states) else None
        ran = pipe.adopt(states) if pipe is not None else None
        batch, numbers, tokens, pass_cells, graphed = ran or self._forward_backward(states)
        grads = [self.slots.grad_arena[slice(*self.slots.regions[s.job_id])] for s in states]
        norms = torch._foreach_norm(grads)
        width = len(self.metric_names)
        lrs = {s.job_id: s.optimizer.param_groups[0]["lr"] for s in states}  # the step's, before its update
        # one sync: every job's numbers and norm; its update's skip and clip decided after it or on the device
        flat, skipped = sync_and_update(states, torch.cat([torch.stack([n.reshape(-1) for n in numbers]).reshape(-1),
                                                           torch.stack(norms).to(numbers[0].dtype)]), width, grads,
                                        then=pipe.launcher(states) if pipe is not None and graphed else None)
        rows = [flat[i * width : (i + 1) * width] for i in range(len(states))]
        report = self._report(states, rows, flat[len(states) * width :], batch, skipped, lrs)
        report.job_tokens, report.pass_cells = {s.job_id: n for s, n in zip(states, tokens, strict=True)}, pass_cells
        if width > 1:
            report.metrics = {s.job_id: dict(zip(self.metric_names[1:], row[1:], strict=True))
                              for s, row in zip(states, rows, strict=True)}
        return report

    def _forward_backward(self, states: list[JobRun]) -> tuple:
        """`step`'s forward and backward: (batch, each job's numbers and tokens, each pass's cells or None, graphed)."""
        per_job = [[self.train_examples[i] for i in s.stream.next_indices(s.spec.batch_size)] for s in states]
        tokens = [sum(sequence_tokens(e) for e in items) for items in per_job]
        passes, pass_cells = self.split_for(tokens) if self.split_for is not None else None, None
        if passes is not None and len(passes) > 1:  # trainer.step_passes: each pass its own jobs
            self.set_recompute(False)
            batch, numbers, pass_cells = forward_backward_passes(self.slots, self._eager_forward_backward,
                                                                 states, per_job, passes)
            return batch, numbers, tokens, pass_cells, False
        if self.step_graphs is not None and self.step_graphs.serves(states):  # recompute decided there
            batch, numbers = self.step_graphs.forward_backward(states, per_job)
            if graph_ahead.NEXT:  # the next step's capture, if it makes one, while the device runs this one
                graph_ahead.capture_next(self.step_graphs, states)
            return batch, numbers, tokens, None, True
        want = None if self.recompute_for is None else self.recompute_for(sum(tokens))
        self.set_recompute(self.gradient_checkpointing if want is None else want)
        batch, numbers = self._eager_forward_backward(states, per_job)
        return batch, numbers, tokens, None, False

    # ----- held-out evaluation (self.evaluation; the objective's sums) ---------------------
    @property
    def eval_metric_names(self) -> tuple[str, ...]:
        return TOKEN_METRICS if self.objective is None else self.objective.eval_metric_names

    def eval_sums(self, states: Sequence[JobRun], chunk: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor]:
        """One no-grad forward of every job on the same chunk: per job the sums of the
        evaluation's numbers [N, len(eval_metric_names)] and what each is averaged over [N]
        (SFT: summed token losses and hits over target tokens; DPO: sums over pairs)."""
        if self.objective is not None:
            return self.objective.eval_sums(self, states, chunk)
        return self.evaluation.token_sums(states, chunk)

    def evaluate_metrics(self, examples: Sequence[Example], batch_size: int = 8, job_ids: Sequence[str] | None = None,
                         max_sequences: int | None = None, forwards: int | None = None) -> dict[str, dict[str, float]]:
        """Each job's evaluation numbers on the same held-out examples (Evaluation.metrics)."""
        return self.evaluation.metrics(examples, batch_size, job_ids, max_sequences, forwards)

    def evaluate(self, examples: Sequence[Example], batch_size: int = 8, job_ids: Sequence[str] | None = None,
                 max_sequences: int | None = None) -> dict[str, float]:
        """The mean loss of each job on the same held-out examples (SFT: token mean; DPO: the
        mean DPO loss over pairs), what early exit and the ranking use."""
        metrics = self.evaluate_metrics(examples, batch_size, job_ids, max_sequences)
        return {j: m["loss"] for j, m in metrics.items()}

    # ----- lockstep passes (adapter parallelism: every rank joins every all-gather) -----------
    @property
    def lockstep(self) -> bool:
        return self.agree is not None

    def idle_step(self) -> None:
        """A rank with no runnable job: a backbone forward + backward over one pad token (nothing updated)."""
        self._prepare([])
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        emb = self.model.get_input_embeddings()
        # the embedding is frozen: let its output require grad so that backward reaches (and
        # all-gathers) every layer, as a real step's LoRA paths make it do
        hook = emb.register_forward_hook(lambda _m, _a, out: out.detach().requires_grad_(True))
        try:
            out = self.model.base_model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False)
        finally:
            hook.remove()
        (out.last_hidden_state.float().sum() * 0.0).backward()

    @torch.no_grad()
    def idle_forward(self) -> None:
        """One backbone forward over one pad token (an evaluation forward with no job)."""
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        self.model.base_model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False)

    def _report(self, states: Sequence[JobRun], rows: list[list[float]], norms: list[float],
                batch: PackedBatch | StepTotals, skipped: list[bool], lrs: dict[str, float]) -> StepReport:
        """The step's report, after each job's clip and AdamW update (trainer.step_update: a job with a
        non-finite loss or norm skipped its own)."""
        report = StepReport({}, {}, {}, {}, batch.real_tokens, batch.padded_fraction)
        report.lrs = lrs
        for s, row, norm, skip in zip(states, rows, norms, skipped, strict=True):
            report.losses[s.job_id], report.skipped[s.job_id], report.grad_norms[s.job_id] = row[0], skip, norm
            report.steps[s.job_id] = s.step
        return report
