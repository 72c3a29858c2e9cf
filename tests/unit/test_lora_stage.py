"""Unit: staged LoRA (trainer.lora_stage, $LORAPLEX_LORA_STAGE): one linear's staged forward and backward against a
float64 reference, the mask, the copies in and out of the stacked buffers, and the engine's steps (eager and graphed,
through a change of job set) equal to its steps without staging. The speed is a device's: bench/lora_concat.py and
bench/host_profile.py under LORAPLEX_LORA_STAGE=1."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.helpers.engine_ref import tiny_model_dir
from trainer import graph_thread, lora_stage
from trainer.lora_stage import StagePlan, Stager, rank_tile, staged_linear
from trainer.multilora import MultiLoraLinear

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference(x, w, bias, factors, counts, scales, dy):  # noqa: ANN001, ANN202
    """float64 y, dX and each job's dA [r, d_in], dB [r, d_out] (A [r, d_in], B [r, d_out] per job)."""
    y, dx = x @ w.t() + bias, dy @ w
    grads, row = [], 0
    for (a, b), c, s in zip(factors, counts, scales, strict=True):
        xs, dys = x[row:row + c], dy[row:row + c]
        y[row:row + c] += s * (xs @ a.t()) @ b
        ds = s * dys @ b.t()
        dx[row:row + c] += ds @ a
        grads.append((ds.t() @ xs, s * (xs @ a.t()).t() @ dys))
        row += c
    return y, dx, grads


def test_a_staged_linear_equals_the_float64_reference_and_its_padding_rows_get_no_lora() -> None:
    g = torch.Generator().manual_seed(0)
    d_in, d_out, ranks, counts, scales, pad = 12, 10, [3, 5], [4, 6], [2.0, 0.5], 3
    t = sum(counts) + pad
    x = torch.randn(t, d_in, generator=g, dtype=torch.float64, requires_grad=True)
    w, bias = torch.randn(d_out, d_in, generator=g, dtype=torch.float64), torch.randn(d_out, generator=g, dtype=torch.float64)
    factors = [(torch.randn(r, d_in, generator=g, dtype=torch.float64), torch.randn(r, d_out, generator=g, dtype=torch.float64))
               for r in ranks]
    plan = StagePlan(slots=2, tile=rank_tile(max(ranks)))
    bufs = lora_stage.StageBuffers.make(d_in, d_out, torch.float64, torch.device("cpu"))
    for i, (a, b) in enumerate(factors):  # slot i's rows at i * tile; the rest stay zero
        bufs.a[i * plan.tile:i * plan.tile + a.shape[0]] = a
        bufs.b[i * plan.tile:i * plan.tile + b.shape[0]] = b
    offsets = torch.tensor([0, counts[0], sum(counts)])
    token = torch.zeros((), requires_grad=True)
    y = staged_linear(x, w, bias, bufs, plan, 0, offsets, torch.tensor(ranks, dtype=torch.int32),
                      torch.tensor(scales), token)
    dy = torch.randn(t, d_out, generator=g, dtype=torch.float64)
    dy[-pad:] = 0  # a step's padding rows get no gradient
    y.backward(dy)
    ref_y, ref_dx, grads = _reference(x.detach()[: sum(counts)], w, bias, factors, counts, scales, dy[: sum(counts)])
    torch.testing.assert_close(y.detach()[: sum(counts)], ref_y)
    torch.testing.assert_close(y.detach()[sum(counts):], x.detach()[sum(counts):] @ w.t() + bias)  # base alone
    torch.testing.assert_close(x.grad[: sum(counts)], ref_dx)
    for i, (da, db) in enumerate(grads):
        lo, r = i * plan.tile, ranks[i]
        torch.testing.assert_close(bufs.da[lo:lo + r], da)
        torch.testing.assert_close(bufs.db[lo:lo + r], db)
        assert not bufs.da[lo + r:(i + 1) * plan.tile].any() and not bufs.db[lo + r:(i + 1) * plan.tile].any()
    mask = plan.mask
    assert mask.shape == (t, 2 * plan.tile) and not mask[sum(counts):].any()
    assert set(mask[0].nonzero()[:, 0].tolist()) == set(range(ranks[0])) and mask[0, 0] == scales[0]
    assert set(mask[-pad - 1].nonzero()[:, 0].tolist()) == set(range(plan.tile, plan.tile + ranks[1]))
    # a second backward in the same eager step adds to the buffers (a first one overwrites)
    before = bufs.da.clone()
    y2 = staged_linear(x, w, bias, bufs, plan, 0, offsets, torch.tensor(ranks, dtype=torch.int32),
                       torch.tensor(scales), token)
    y2.backward(dy)
    torch.testing.assert_close(bufs.da, 2 * before)


def _stager_case() -> tuple[Stager, list[MultiLoraLinear], torch.Tensor, torch.Tensor, list[int], list[int]]:
    torch.manual_seed(0)
    layers = [MultiLoraLinear(nn.Linear(4, 6), "p"), MultiLoraLinear(nn.Linear(6, 4), "q")]
    ranks = [2, 3]
    # arena: layer-major A then B blocks per job, with gaps
    ints_a, ints_b, pos = [], [], 1
    for m in layers:
        for r in ranks:
            ints_a.append(pos)
            pos += r * m.in_features + 2
    for m in layers:
        for r in ranks:
            ints_b.append(pos)
            pos += r * m.out_features + 1
    arena = torch.randn(pos, dtype=torch.float64)
    grad = torch.randn(pos, dtype=torch.float64)
    return Stager(layers, torch.float64, torch.device("cpu")), layers, arena, grad, ints_a + ints_b, ranks


def test_stage_in_copies_every_jobs_blocks_and_a_new_layout_clears_rows_no_job_owns() -> None:
    stager, layers, arena, grad, ints, ranks = _stager_case()
    plan = StagePlan(2, 16)
    stager.stage_in(plan, arena, grad, ints, ranks)
    n = len(ranks)
    for k, m in enumerate(layers):
        bufs = m.stage_bufs
        assert bufs is stager.bufs[k] and m.stage_index == k
        for i, r in enumerate(ranks):
            a_off, b_off = ints[k * n + i], ints[len(layers) * n + k * n + i]
            torch.testing.assert_close(bufs.a[16 * i:16 * i + r], arena[a_off:a_off + r * m.in_features].view(r, -1))
            torch.testing.assert_close(bufs.b[16 * i:16 * i + r], arena[b_off:b_off + r * m.out_features].view(r, -1))
    # the same layout after an update: the new values come in
    arena.mul_(2)
    stager.stage_in(plan, arena, grad, ints, ranks)
    m = layers[0]
    torch.testing.assert_close(m.stage_bufs.a[:2], arena[ints[0]:ints[0] + 8].view(2, 4))
    # a lower rank in slot 1: its old third row is cleared, not left for the mask to multiply
    stager.stage_in(plan, arena, grad, ints, [2, 1])
    assert not m.stage_bufs.a[17:19].any() and m.stage_bufs.a[16].any()


def test_flush_adds_the_gradient_rows_once_and_only_of_the_linears_whose_backward_ran() -> None:
    stager, layers, arena, grad, ints, ranks = _stager_case()
    plan = StagePlan(2, 16)
    stager.stage_in(plan, arena, grad, ints, ranks)
    for bufs in stager.bufs:
        bufs.da.fill_(1.0)
        bufs.db.fill_(1.0)
    plan.seen.add(0)  # the second linear's backward never ran (a forward that stopped short)
    before = grad.clone()
    stager.flush()
    stager.flush()  # nothing pending: nothing added twice
    moved = (grad - before).nonzero()[:, 0]
    n = len(ranks)
    want = set()
    for i, r in enumerate(ranks):
        a_off, b_off = ints[i], ints[len(layers) * n + i]
        want |= set(range(a_off, a_off + r * 4)) | set(range(b_off, b_off + r * 6))
    assert set(moved.tolist()) == want
    torch.testing.assert_close(grad[moved], before[moved] + 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN201
    return tiny_model_dir("llama", tmp_path_factory.mktemp("stage"))


def _engine(model_dir, graphs: bool, data):  # noqa: ANN001, ANN202
    from tests.unit.test_step_graphs import engine

    return engine(model_dir, graphs, data)


@pytest.mark.parametrize("graphs", [False, True])
def test_staged_steps_equal_unstaged_steps_through_a_change_of_job_set(model_dir, monkeypatch, graphs) -> None:  # noqa: ANN001
    from tests.unit.test_step_graphs import examples, job

    monkeypatch.setattr(graph_thread, "ON", False)
    data = examples(48, 24)
    monkeypatch.setattr(lora_stage, "STAGE", False)
    plain = _engine(model_dir, graphs, data)
    monkeypatch.setattr(lora_stage, "STAGE", True)
    staged = _engine(model_dir, graphs, data)
    assert plain.slots.stager is None and staged.slots.stager is not None
    seen: list[StagePlan | None] = []
    layer = staged.layer_list[0]
    orig = type(layer).forward

    def spy(self, x):  # noqa: ANN001, ANN202
        if self is layer and self.layout is not None:
            seen.append(self.layout.stage)
        return orig(self, x)

    monkeypatch.setattr(type(layer), "forward", spy)

    def both(n: int) -> None:
        for _ in range(n):
            want, got = plain.step(), staged.step()
            for j in want.losses:
                assert math.isclose(got.losses[j], want.losses[j], rel_tol=2e-5), j
                assert math.isclose(got.grad_norms[j], want.grad_norms[j], rel_tol=1e-4), j

    for eng in (plain, staged):  # 2 jobs of rank tile 64: 128 stacked rows (a graph key's 8 job slots would be 512)
        for spec in (job("a", 16, 2, 1), job("b", 64, 2, 2)):
            eng.attach(spec)
    both(3)
    for eng in (plain, staged):  # another job of another rank (the same tile) takes a's slot
        eng.detach("a")
        eng.attach(job("c", 8, 2, 3, lr=1e-2))
    both(3)
    for j in ("b", "c"):
        torch.testing.assert_close(staged.jobs[j].adapter.flat, plain.jobs[j].adapter.flat, rtol=1e-4, atol=1e-6)
    assert seen and all(p is not None and p.rows == 128 for p in seen)  # every step's forward staged
    if graphs:
        g = staged.step_graphs
        assert g.replays > 0 and all(p.graph for p in seen) and {k.stage for k in g.entries} == {2}
        assert g.captures == 1, list(g.entries)  # the new job set replays the same capture


def test_a_step_whose_stacked_ranks_pass_the_cap_runs_the_arena_operator(model_dir, monkeypatch) -> None:  # noqa: ANN001
    from tests.unit.test_step_graphs import examples, job

    monkeypatch.setattr(lora_stage, "STAGE", True)
    monkeypatch.setattr(lora_stage, "CAP", 32)
    eng = _engine(model_dir, False, examples(24, 24))
    for spec in (job("a", 4, 2, 1), job("b", 8, 2, 2)):  # 2 slots x tile 16 = 32
        eng.attach(spec)
    monkeypatch.setattr(lora_stage, "CAP", 16)
    eng.step()
    assert eng.slots.stager.pending is None and eng.slots.stager._views is None
    monkeypatch.setattr(lora_stage, "CAP", 32)
    eng.step()
    assert eng.slots.stager._views is not None


def test_a_moved_engine_drops_its_staging_and_runs_the_arena_operator(model_dir, monkeypatch) -> None:  # noqa: ANN001
    from tests.unit.test_step_graphs import examples, job

    monkeypatch.setattr(lora_stage, "STAGE", True)
    eng = _engine(model_dir, False, examples(24, 24))
    assert eng.slots.stager is not None and all(m.stage_bufs is not None for m in eng.layer_list)
    eng.move_to(torch.device("cpu"))  # what adapter parallelism's shard_engine does after sharding
    assert eng.slots.stager is None and all(m.stage_bufs is None for m in eng.layer_list)
    eng.attach(job("a", 4, 2, 1))
    assert math.isfinite(eng.step().losses["a"])


def test_after_a_jobs_non_finite_step_its_sets_run_the_arena_operator_and_its_step_mates_train(model_dir, monkeypatch) -> None:  # noqa: ANN001, E501
    """A job's non-finite gradients stay its own in a staged step (the mask's where keeps its columns out of its
    step-mates' rows). Its non-finite rows would not (the weight-gradient GEMMs sum over every row: 0 * NaN), so from
    then on a set holding a job that ever skipped runs the arena operator, and its step-mates train on."""
    from tests.unit.test_step_graphs import examples, job

    monkeypatch.setattr(graph_thread, "ON", False)
    monkeypatch.setattr(lora_stage, "STAGE", True)
    eng = _engine(model_dir, False, examples(48, 24))
    for spec in (job("a", 4, 2, 1), job("b", 8, 2, 2)):
        eng.attach(spec)
    first = eng.step()
    assert not any(first.skipped.values()) and eng.slots.stager._views is not None
    with torch.no_grad():
        eng.jobs["b"].adapter.flat.mul_(1e30)  # b's rows overflow: non-finite gradients
    hit = eng.step()
    assert hit.skipped["b"] and not math.isfinite(hit.grad_norms["b"])
    assert not hit.skipped["a"] and math.isfinite(hit.grad_norms["a"])  # a's rows and gradients untouched
    staged: list[object] = []
    orig = eng.slots.stage_in

    def spy(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        staged.append(orig(*args, **kw))
        return staged[-1]

    monkeypatch.setattr(eng.slots, "stage_in", spy)
    later = [eng.step() for _ in range(2)]
    assert staged and all(p is None for p in staged)  # b's sets no longer stage
    assert all(not r.skipped["a"] and r.skipped["b"] for r in later)
    assert all(math.isfinite(r.losses["a"]) and math.isfinite(r.grad_norms["a"]) for r in later)
