"""The training step's forward and backward replayed as CUDA graphs, one per shape key, so the host does not
bound the step: at 32 layers an eager step launches ~6.5k kernels and the GPU sat idle two thirds of its wall
(bench/results/host_profile_h100_recompute.md).

What varies per step lives in device tensors that one capture reads (`_Static`): the packed tokens, positions,
next-token targets, each token's job slot, the sequence bounds, and the job layout (every layer's arena
offsets, ranks, scalings, token offsets). A key fixes only shapes: tokens T (flat varlen packing, `per_octave`
sizes per doubling), sequence slots, job slots and the rank tile, all rounded up, so admitting, finishing or
exiting a job refills the same buffers and replays the same graph. Empty job slots own no tokens (zero-length
groups: the kernels do no work for them). The graph holds: the gradient arena's zeroing, the backbone forward
with the multi-LoRA layers, the head's per-token losses over every position (ignored targets count zero), each
job's mean loss (segment sums by slot), the non-finite guard and the backward into the gradient arena. What
follows the graph (norms, the one sync, clipping, AdamW) is the engine's, as in eager steps.

Keys over MAX_CAPTURE_TOKENS (evaluation: MAX_EVAL_CAPTURE_TOKENS) run eagerly on their buffers. The first key
of a class (`GraphKey.warm_class`) runs eagerly (it compiles and loads every kernel: nothing may wait for the
device inside a capture); a key of a warm class is captured at its first step, unless a captured key within
`cover_ratio` of its tokens can run it padded. All graphs share one memory pool; a capture the device lacks
the free memory for waits (`graph_parts.capture_short`); a training key of TRANSIENT_MIN_TOKENS or more runs
eagerly while its job set runs under TRANSIENT_SET_STEPS more steps (`set_lasts`); graphs live in their process
only; the arena growing or packed drops them, and so does a step that runs without recompute only once a mostly
stale pool is gone (`stale_pool`). A capture may run on a thread a few steps ahead (trainer.graph_thread,
`flight`). Without CUDA graphs (CPU tests) the same body runs eagerly on the same static buffers (`_Replay`),
which is what the tests compare against the engine's eager step.
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

import torch
from torch import nn

from trainer import graph_ahead, graph_parts, graph_thread
from trainer.arena import AdapterArena
from trainer.data import IGNORE, Example
from trainer.graph_parts import CAPTURE_RETRY_STEPS, GraphKey, capture_short, memory_report
from trainer.graph_parts import Entry as _Entry
from trainer.graph_parts import Replay as _Replay
from trainer.graph_parts import Static as _Static
from trainer.graph_parts import capturing as _capturing
from trainer.head import token_losses, token_losses_and_hits
from trainer.jobs import JobRun
from trainer.multilora import MultiLoraLinear, StepLayout
from trainer.packing import PackedBatch, pack_flat

log = logging.getLogger(__name__)


class GraphedEngine(Protocol):
    """What a graphed step uses of its engine (trainer.engine.MultiLoraEngine)."""

    model: nn.Module
    device: torch.device
    compute_dtype: torch.dtype
    attention: str
    pad_id: int
    head_chunk: int
    gradient_checkpointing: bool
    layer_list: list[MultiLoraLinear]
    slots: AdapterArena  # the arenas, their token and kernel backend, the job layout
    forward_shapes: Counter
    output_logits: Callable[[torch.Tensor], torch.Tensor]
    # a step row's tokens -> whether it needs recompute (trainer.memory_plan; None: the setting stays)
    recompute_for: Callable[..., bool | None] | None

    def set_recompute(self, on: bool) -> None: ...
    def cap_for(self, train: bool) -> int: ...
    def grow_cap(self, train: bool, longest: int) -> int: ...

    @property
    def lockstep(self) -> bool: ...

    @property
    def plain_objective(self) -> bool: ...


# Keys of more tokens run eagerly, never captured: their kernels keep the GPU busy while the host
# launches the next (at 32 layers of 8B from ~4k tokens), while a capture costs ~1 s and keeps its
# activations in the pool for good: an H200 search's 57k-token captures left evaluation 8 sequences a
# forward (16 s); an H100's 14.5k-token capture took 15.6 GB and a later step ran out of memory.
MAX_CAPTURE_TOKENS = 8192
# An evaluation forward (a third of a step's launches) keeps the GPU busy from fewer tokens and its
# keys seldom repeat: larger ones run eagerly (a task's evaluations do anyway, on their arena copy).
MAX_EVAL_CAPTURE_TOKENS = 4096
# A step of a new key replays a captured one of at most cover_ratio (1.19) times its tokens, or of at
# most COVER_TOKENS more: below ~2k tokens a replay's time hardly grows with its tokens (2 jobs at 32
# layers of 8B on an H100: 0.062 s at 150 tokens, 0.088 s at 600) and a capture costs ~0.3 s. A key
# covered CAPTURE_AFTER times is captured at its next step (padding it for good costs more).
COVER_TOKENS = 512
CAPTURE_AFTER = 8
# A capture without recompute decides with the recompute policy's padding allowance (its memory stays
# in the pool): StepGraphs._recompute_key.
CAPTURE_PADDING = 1.25
STALE_STEPS = 16  # captures no step ran for this many steps are stale (StepGraphs.stale_pool)
# with fewer steps than this left to run, a key a capture can replay padded is not captured: a capture
# costs 0.25-0.8 s over a replay and a padded replay ~0.03 s (search (a)'s 2-job tail captured 3 keys in
# its last 18 steps, ~0.7 s); the executor gives the steps left (`steps_left`)
CAPTURE_HORIZON = 16
# a training key of this many tokens or more is not captured while its job set runs under TRANSIENT_SET_STEPS
# more steps (`set_lasts`; a larger capture may still run it padded, `_cover_for`): its eager run costs about a
# replay (GEMM-bound). Search (a)'s 24- and 12-job sets captured such keys, never replayed (+0.25-0.46 s over
# eager; a 42 GB pool made the next step recompute); the 200-step task's 10-step 8-job set took 5.62 s
# with its captures, 5.04 s without, side by side on an H200 (bench/results/session49_h200.md)
TRANSIENT_MIN_TOKENS = 2048
TRANSIENT_SET_STEPS = 16


class StepGraphs:
    """The engine's graphed training steps (SFT on the varlen packing, one GPU); `serves` says
    whether a step can take this path, `forward_backward` runs it."""

    def __init__(self, engine: GraphedEngine, per_octave: int = graph_parts.GRAPH_BUCKETS, max_graphs: int = 64,
                 cover_ratio: float = 1.19, max_capture_tokens: int = MAX_CAPTURE_TOKENS,
                 max_eval_capture_tokens: int = MAX_EVAL_CAPTURE_TOKENS, cover_tokens: int = COVER_TOKENS,
                 capture_after: int = CAPTURE_AFTER) -> None:
        self.engine = engine
        self.per_octave = per_octave
        self.max_capture_tokens = max_capture_tokens  # larger keys run eagerly (see MAX_CAPTURE_TOKENS)
        self.max_eval_capture_tokens = max_eval_capture_tokens  # the same for evaluation forwards
        self.cover_ratio = cover_ratio  # a step replays a capture of up to this many times its tokens
        self.cover_tokens = cover_tokens  # ... or of up to this many tokens more (small steps)
        self.capture_after = capture_after  # a key covered this many times is captured at its next step
        self.cover_uses: Counter[GraphKey] = Counter()
        self.max_graphs = max_graphs
        self.warm: set[tuple] = set()  # key classes that ran eagerly in this process
        self.entries: OrderedDict[GraphKey, _Entry] = OrderedDict()
        self.pool = None
        self.captures = 0
        self.replays = 0
        self.eager_runs = 0
        self.failures = 0
        self.deferrals = 0  # captures put off: the device had too little free memory for their pool
        self.capture_s = [0.0, 0.0]  # the captures' host passes and their ends (instantiation), seconds
        # a training key's tokens, recompute -> the bytes its capture keeps in the pool (None: unknown;
        # the executor's memory plan, MemoryPlan.capture_bytes)
        self.capture_need: Callable[[int, bool], float | None] | None = None
        self.covered = 0  # steps that replayed a larger key's capture (padded) instead of capturing
        self.ahead: Counter[str] = Counter()  # captures ahead ("made") and why keys were left (trainer.graph_ahead)
        self.flight: graph_thread.Flight | None = None  # a capture under way on a thread
        self._storage = None  # (arena, grad arena) storages the graphs read and write
        self.pool_bytes = 0  # device memory the captures' pool took
        self.last_replayed = False  # the last step replayed an earlier capture
        self.calls = 0  # steps and forwards run
        # -> the steps left to run (None: not known, or more will come; the executor's graph_parts.steps_left)
        self.steps_left: Callable[[], int | None] | None = None
        # -> the steps the attached job set runs unchanged, this one included (1: it changes after
        # this step; None: not known; the executor's graph_parts.set_lasts)
        self.set_lasts: Callable[[], int | None] | None = None

    # ----- which steps -----------------------------------------------------------------
    def serves(self, states: Sequence[JobRun]) -> bool:
        eng = self.engine
        return bool(states) and eng.attention == "varlen" and not eng.lockstep and eng.plain_objective

    @staticmethod
    def use_cuda_graphs(device: torch.device) -> bool:
        return device.type == "cuda"

    # ----- one step --------------------------------------------------------------------
    def forward_backward(self, states: Sequence[JobRun], per_job: Sequence[Sequence[Example]]
                         ) -> tuple[PackedBatch, list[torch.Tensor]]:
        """The step's forward and backward: its host batch and each job's mean loss (device)."""
        cpu, entry, _ = self._execute(states, per_job, train=True)
        out = entry.static.out
        return cpu, [out[i, :1] for i in range(len(states))]

    def eval_sums(self, states: Sequence[JobRun], chunk: Sequence[Example]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """One no-grad forward of every job on the same chunk: per job [loss sum, hit sum] over its
        target tokens (device, read before the next replay) and its target count (host, float64):
        MultiLoraEngine.eval_sums' contract."""
        _, entry, counts = self._execute(states, [chunk] * len(states), train=False)
        return entry.static.out[: len(states)], counts[: len(states)].double()

    def _execute(self, states: Sequence[JobRun], per_job: Sequence[Sequence[Example]], train: bool
                 ) -> tuple[PackedBatch, _Entry, torch.Tensor]:
        """Pack, fill the key's buffers and run its graph (captured now if its class is warm, else
        eagerly): the host batch, the entry and each slot's target count."""
        eng = self.engine
        n_seqs = sum(len(seqs) for seqs in per_job)
        self._check_storage()
        key, cpu, ints = graph_parts.step_key(eng, self.per_octave, states, per_job, train, eng.cap_for(train))
        eng.grow_cap(train, key.max_len)  # the longest sequence so far (of the steps, or of the evaluations)
        if train and eng.recompute_for is not None:
            key = self._recompute_key(key, cpu.real_tokens, n_seqs)
        cover = self._cover_for(key, cpu.real_tokens, n_seqs) \
            or graph_ahead.widen(self, states, key, cpu.real_tokens, n_seqs, train)
        if cover is not None:  # replay a larger capture (or capture the next step's key: widen) rather than capture this key
            self.cover_uses[key] += 1
            key = cover
            cpu = pack_flat(per_job, eng.pad_id, length=cover.tokens, max_len=eng.cap_for(train))
            self.covered += 1
        if (flew := self.flight is not None) and ((k := self.entries.get(key)) is None or k.graph is None or self.flight.done.is_set()):
            graph_thread.settle(self)  # this step captures or runs eagerly, or the thread's capture is done
        entry = self._entry(key)
        entry.last = self.calls = self.calls + 1
        counts = self._fill(entry.static, key, cpu, states, ints)
        eng.forward_shapes[(*cpu.input_ids.shape, train)] += 1
        limit = self.max_capture_tokens if train else min(self.max_capture_tokens, self.max_eval_capture_tokens)
        captured_now = self._captures(key, limit)
        if captured_now:
            entry.graph = self._capture(entry, key)
        # a replay allocates nothing (its memory is the pool's); a step begun beside a capture on a thread: not observed
        self.last_replayed = entry.graph is not None and not captured_now or flew
        if entry.graph is not None:
            entry.graph.replay()
            self.replays += 1
        else:
            self._run(entry.static, key)
            self.eager_runs += 1
            self.warm.add(key.warm_class)
        return cpu, entry, counts

    def _recompute_key(self, key: GraphKey, n_tokens: int, n_seqs: int) -> GraphKey:
        """Recompute off or on for a training step, from what the step will run (the memory plan's
        `recompute_for(tokens, padding)` on the row's exact tokens):
        - a replay of a capture without recompute (the key's own or a cover): off, whatever the
          room (a replay allocates nothing: its memory is the pool's, counted resident);
        - an eager run: off where the row fits as it is (padding 1.0; its memory goes back after it);
        - a capture: off only with CAPTURE_PADDING's allowance, the engine's eager rule: a capture
          keeps its activations in the graphs' pool for the process's life. On an H100 (session
          30) a 60-step task's 7,168-token key captured without recompute held 40 GB of pool: its
          later steps recomputed and its evaluation ran 13 sequences a forward (11.0 s, not 4.2).
        With these rules search (a) ran 73-80 of its 129 steps without recompute, against 56 under
        the eager rule alone (its 5-job steps 0.14-0.17 s against 0.21-0.30 s)."""
        on = self.recompute_on(key, n_tokens, n_seqs)
        if on is None:  # no policy: the setting stays
            return key
        self.engine.set_recompute(on)
        return replace(key, recompute=on)

    def recompute_on(self, key: GraphKey, n_tokens: int, n_seqs: int) -> bool | None:
        """`_recompute_key`'s decision for a training key, without setting it (None: no policy)."""
        off = replace(key, recompute=False)
        known = self.entries.get(off)
        replays = (known is not None and known.graph is not None) or self._cover_for(off, n_tokens, n_seqs) is not None
        captures = not replays and self._captures(off, self.max_capture_tokens)
        want = self.engine.recompute_for(off.tokens, padding=CAPTURE_PADDING if captures else 1.0)  # type: ignore[misc]
        return None if want is None else bool(want) and not replays

    def _cover_for(self, key: GraphKey, n_tokens: int, n_seqs: int, ahead: int = 0) -> GraphKey | None:
        """`_cover`, where one may serve: the key not captured, its class warm, covered < capture_after
        (a key whose capture failed or was deferred, or with under CAPTURE_HORIZON steps left, any
        number of times). `ahead`: as the step that many steps on reads it (graph_ahead.capture_next)."""
        known = self.entries.get(key)
        if (known is not None and known.graph is not None) or key.warm_class not in self.warm:
            return None
        barred = known is not None and (known.failed or known.deferred >= 0)
        # past capture_after the key is captured, unless it may not be (`_transient`): then it stays covered
        if not barred and self.cover_uses[key] >= self.capture_after and not self._near_end(ahead) \
                and not self._transient(key, ahead):
            return None
        return self._cover(key, n_tokens, n_seqs)

    def _near_end(self, ahead: int = 0) -> bool:
        """Under CAPTURE_HORIZON steps left to run (`steps_left`, `ahead` steps on; unknown: not near)."""
        left = self.steps_left() if self.steps_left is not None else None
        return left is not None and left - ahead < CAPTURE_HORIZON

    def _captures(self, key: GraphKey, limit: int, ahead: int = 0) -> bool:
        """Whether a step of `key` is captured now: not yet (nor failed, nor deferred in the last
        CAPTURE_RETRY_STEPS steps), its class warm, <= limit tokens, not `_transient` (`ahead` steps on)."""
        entry = self.entries.get(key)
        waits = entry is not None and entry.deferred >= 0 and self.calls - entry.deferred < CAPTURE_RETRY_STEPS
        return ((entry is None or (entry.graph is None and not entry.failed and not waits))
                and key.warm_class in self.warm and key.tokens <= limit and not self._transient(key, ahead))

    def _transient(self, key: GraphKey, ahead: int = 0) -> bool:
        """A training key of TRANSIENT_MIN_TOKENS or more whose job set runs under TRANSIENT_SET_STEPS
        more steps, this one included (`set_lasts`, `ahead` steps on)."""
        if not key.train or key.tokens < TRANSIENT_MIN_TOKENS or self.set_lasts is None:
            return False
        lasts = self.set_lasts()
        return lasts is not None and lasts - ahead < TRANSIENT_SET_STEPS

    def _cover(self, key: GraphKey, n_tokens: int, n_seqs: int) -> GraphKey | None:
        """The smallest captured key that can run this step padded (at most `cover_ratio` times this key's tokens
        or `cover_tokens` more, enough sequence and job slots, a rank tile as large)."""
        best = None
        for k, e in self.entries.items():
            if e.graph is None or (k.max_len, k.aligned, k.recompute, k.train) != (
                    key.max_len, key.aligned, key.recompute, key.train):
                continue
            if k.job_slots < key.job_slots or k.rank < key.rank:
                continue
            if not n_tokens <= k.tokens <= max(self.cover_ratio * key.tokens, key.tokens + self.cover_tokens):
                continue
            pieces = -(-(k.tokens - n_tokens) // key.max_len)  # the padding tail's sequences
            if k.seq_slots < n_seqs + pieces:
                continue
            if best is None or (k.tokens, k.job_slots, k.rank) < (best.tokens, best.job_slots, best.rank):
                best = k
        return best

    def _check_storage(self) -> None:
        now = self.engine.slots.storage()
        if self._storage is not None and now != self._storage:
            self.reset()  # the arena grew or was packed: every capture points at the old storage
        self._storage = now

    def reset(self) -> None:
        """Drop every capture (their memory goes back with the pool)."""
        graph_thread.settle(self)
        self.entries.clear()
        self.cover_uses.clear()
        self.pool = None
        self.pool_bytes = 0

    def _entry(self, key: GraphKey) -> _Entry:
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= self.max_graphs:
                self.entries.popitem(last=False)  # the least recently used key
            entry = _Entry(_Static(key, len(self.engine.layer_list), self.engine.device))
            self.entries[key] = entry
        self.entries.move_to_end(key)
        return entry

    # ----- the static inputs -----------------------------------------------------------
    def _fill(self, st: _Static, key: GraphKey, cpu: PackedBatch, states: Sequence[JobRun],
              ints: list[int]) -> torch.Tensor:
        """One host buffer of the step's ints (and one of its floats), copied to the key's
        buffers asynchronously: empty job slots own no tokens, spare sequence bounds are empty.
        Returns each slot's target count."""
        t, n, n_jobs = key.tokens, key.job_slots, len(states)
        n_layers = len(self.engine.layer_list)
        owned = list(cpu.token_offsets)  # pack_flat's: the padding tail is the last job's rows (zero loss)
        bounds = owned[:-1] + [cpu.real_tokens] if graph_parts.FREE_PADDING else owned  # the kernels' job rows
        cu = list(cpu.cu_seqlens) + [t] * (key.seq_slots + 1 - len(cpu.cu_seqlens))
        job = torch.repeat_interleave(torch.arange(n_jobs), torch.tensor(owned).diff())
        a_pad = [0] * (n - n_jobs)

        def per_slot(values: list[int]) -> list[int]:
            return [v for k in range(n_layers) for v in values[k * n_jobs : (k + 1) * n_jobs] + a_pad]

        half = n_layers * n_jobs
        tail = per_slot(ints[:half]) + per_slot(ints[half:])
        tail += [s.adapter.rank for s in states] + a_pad + bounds + [bounds[-1]] * (n - n_jobs)
        counts = torch.zeros(n, dtype=torch.float32)
        counts.index_add_(0, job, (cpu.targets.reshape(-1) != IGNORE).to(torch.float32))
        scales = [s.adapter.scaling for s in states] + [0.0] * (n - n_jobs)
        st.load([cpu.input_ids.reshape(-1), cpu.position_ids.reshape(-1), cpu.targets.reshape(-1), job,
                 torch.tensor(cu + tail, dtype=torch.int64)],
                [torch.tensor(scales, dtype=torch.float32), counts.clamp(min=1.0)])
        return counts

    # ----- the body, its eager run and its capture -------------------------------------
    def _run(self, st: _Static, key: GraphKey) -> None:
        """The graph's body: the backbone over the static batch with the static job layout, then
        the training objective and its backward, or the evaluation's sums."""
        eng, slots = self.engine, self.engine.slots
        arena, grad_arena = slots.layout_arenas()  # never an evaluation's copy here (it runs eagerly)
        lay = StepLayout(offsets=st.offsets, scales=st.scales, ranks=st.ranks.to(torch.int32), arena=arena,
                         grad_arena=grad_arena, r_max=key.rank, token=slots.token, backend=slots.backend,
                         aligned=key.aligned)
        for k, layer in enumerate(eng.layer_list):
            layer.layout, layer.a_off, layer.b_off = lay, st.a_off[k], st.b_off[k]
        try:
            if key.train:
                self._train_body(st, key)
            else:
                with torch.no_grad():
                    self._eval_body(st, key)
        finally:
            slots.clear_layout()

    def _hidden(self, st: _Static, key: GraphKey) -> torch.Tensor:
        cu = st.cu.to(torch.int32)
        out = self.engine.model.base_model(
            input_ids=st.input_ids, position_ids=st.position_ids, use_cache=False, cu_seq_lens_q=cu,
            cu_seq_lens_k=cu, max_length_q=key.max_len, max_length_k=key.max_len)
        return out.last_hidden_state.reshape(key.tokens, -1)

    def _train_body(self, st: _Static, key: GraphKey) -> None:
        eng = self.engine
        eng.slots.grad_arena.zero_()
        losses = token_losses(eng.output_logits, self._hidden(st, key), st.targets, eng.head_chunk)
        sums = torch.zeros(key.job_slots, dtype=losses.dtype, device=losses.device)
        means = sums.index_add_(0, st.job_of_token, losses) / st.counts
        # a non-finite mean counts zero in the objective: its job alone gets non-finite
        # gradients (its rows and its arena region) and skips its update after the graph
        kept = torch.where(torch.isfinite(means), means, torch.zeros_like(means))
        kept.sum().backward()
        st.out[:, 0].copy_(means.detach())

    def _eval_body(self, st: _Static, key: GraphKey) -> None:
        eng = self.engine
        losses, hits = token_losses_and_hits(eng.output_logits, self._hidden(st, key), st.targets, eng.head_chunk)
        st.out.zero_()
        st.out[:, 0].index_add_(0, st.job_of_token, losses.float())
        st.out[:, 1].index_add_(0, st.job_of_token, hits.float())

    def _capture(self, entry: _Entry, key: GraphKey, sync: bool = True) -> torch.cuda.CUDAGraph | _Replay | None:
        """The key's graph, captured now (None: the capture failed, the key stays eager; or the device lacks the
        free memory its pool needs, `capture_need`: it is tried again later). Relaxed capture: a kernel of another
        token count may still compile or load its module inside it; anything that waits for the device fails the
        capture instead, and the step runs eagerly. sync=False: no device sync first (a capture ahead or on a
        thread: trainer.graph_ahead, trainer.graph_thread)."""
        st, device = entry.static, self.engine.device
        cuda = self.use_cuda_graphs(device)
        need = self.capture_need(key.tokens, key.recompute) if self.capture_need and key.train else None
        # the eager runs' cached blocks go back first where the device lacks room for the graph's pool
        short = capture_short(device, need, self.pool_bytes, sync)
        if short is not None:
            entry.deferred = self.calls
            self.deferrals += 1
            (log.warning if sync else log.info)("step graph capture deferred for %s: %s", key, short)
            return None
        self.captures += 1
        if not cuda:
            return _Replay(lambda: self._run(st, key))
        graph = torch.cuda.CUDAGraph()
        before = torch.cuda.memory_reserved(device)
        cap = _capturing(graph, self.pool, "relaxed", need, sync)
        try:
            with cap:
                self._run(st, key)
        except RuntimeError as err:
            entry.failed = True
            self.failures += 1
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # what the failed capture allocated: the eager step starts clean
            (log.warning if sync else log.info)("step graph capture failed for %s: %s [%s]", key,
                                                 str(err).split(". ")[0][:200], memory_report(device))
            return None
        self.capture_s[0] += cap.body_s
        self.capture_s[1] += cap.end_s
        if self.pool is None:
            self.pool = graph.pool()
        # the pool's memory: kept for the replays, invisible to memory_allocated (admission adds it)
        entry.pool = max(0, torch.cuda.memory_reserved(self.engine.device) - before)
        self.pool_bytes += entry.pool
        return graph

    def stale_pool(self, idle: int = STALE_STEPS) -> int:
        """The pool's bytes where at least half are captures no step ran in the last `idle` steps (the
        200-step task's first large keys: 126 small steps recomputed beside them); else 0."""
        stale = sum(e.pool for e in self.entries.values() if self.calls - e.last >= idle)
        return self.pool_bytes if 2 * stale >= self.pool_bytes > 0 else 0

    def stats(self) -> dict[str, int]:
        return {"graphs": sum(e.graph is not None for e in self.entries.values()), "captures": self.captures,
                "replays": self.replays, "eager_runs": self.eager_runs, "failures": self.failures,
                "deferrals": self.deferrals, "covered": self.covered, "ahead": self.ahead["made"],
                "capture_host_ms": round(1e3 * self.capture_s[0]),
                "capture_end_ms": round(1e3 * self.capture_s[1]), **{f"ahead_{k}": v for k, v in self.ahead.items()}}
