"""The fused MLP's down input rebuilt in the backward (trainer.fused_blocks.MLP_REBUILD) on CPU, run by
Triton's interpreter in a subprocess: an engine on a fused tiny Llama, steps without recompute.

- With the rebuild, silu(gate) * up is freed once the MLP's forward returns (nothing keeps it for the
  backward); without it, down_proj's backward keeps it until the backward.
- Three steps of four jobs give the same losses and adapters to the bit with and without it (the
  backward rebuilds the same values with the same kernel).
- With recompute on the engine turns the rebuild off (a checkpointed layer saves as
  torch.utils.checkpoint expects), and on again for a step without.
"""
from __future__ import annotations

import pytest

from tests.helpers.interpreted import run_interpreted

pytest.importorskip("triton")

_WORKER = r"""
import gc
import tempfile
import weakref
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir
from trainer import fused_blocks as fb
from trainer.data import parse_record, tokenize_all
from trainer.engine import MultiLoraEngine
from trainer.jobs import TrainJob

d = tiny_model_dir("llama", Path(tempfile.mkdtemp()))
tok = AutoTokenizer.from_pretrained(d)
ex = tokenize_all(tok, [parse_record(r) for r in synthetic_rows(24, seed=3)], 48)
products = []  # weakrefs to every silu(gate) * up the fused MLPs made
own_silu_mul = fb.silu_mul
def watched(gate, up):
    h = own_silu_mul(gate, up)
    if h.requires_grad:
        products.append(weakref.ref(h))
    return h
fb.silu_mul = watched

def build(rebuild):
    fb.MLP_REBUILD = rebuild
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    fb.fuse_blocks(model, force=True)
    eng = MultiLoraEngine(model, ex, tok.pad_token_id, attention="varlen", step_graphs=False,
                          gradient_checkpointing=False)
    for i, r in enumerate((4, 8, 16, 4)):
        eng.attach(TrainJob(f"j{i}", lora_rank=r, lora_alpha=2.0 * r, learning_rate=5e-3, batch_size=1 + i % 2,
                            seed=10 + i, max_steps=10))
    return eng

runs = {}
for rebuild in (False, True):
    eng = build(rebuild)
    flags = lambda: sorted({getattr(m, "_loraplex_rebuild", None) for m in eng.model.modules()
                            if getattr(m.forward, "__func__", None) is fb._fused_mlp_forward})
    out[f"flags {rebuild}"] = flags()
    out[f"rebuilds {rebuild}"] = fb.mlp_rebuilds(eng.model)
    # one forward and loss by hand, the backward not yet run: are the MLPs' products still alive?
    states = list(eng.jobs.values())
    per_job = [[eng.train_examples[i] for i in s.stream.next_indices(s.spec.batch_size)] for s in states]
    for s in states:
        s.stream.load_state_dict({"n": s.stream.n, "seed": s.stream.seed, "epoch": 0, "pos": 0})
    del products[:]
    eng._prepare(per_job)
    batch, losses, _ = eng._losses(states, per_job)
    gc.collect()
    out[f"alive {rebuild}"] = [r() is not None for r in products]
    torch.stack(losses).sum().backward()
    eng.slots.clear_layout()
    del losses, batch
    eng.slots.grad_arena.zero_()
    steps = [eng.step().losses for _ in range(3)]
    eng.set_recompute(True)
    out[f"flags {rebuild} recompute"] = flags()
    eng.set_recompute(False)
    out[f"flags {rebuild} again"] = flags()
    runs[rebuild] = (steps, {j: torch.cat([p.detach().flatten() for p in s.adapter.parameters()])
                             for j, s in eng.jobs.items()})
out["same losses"] = runs[True][0] == runs[False][0]
out["same adapters"] = all(torch.equal(runs[True][1][j], a) for j, a in runs[False][1].items())
out["steps"] = len(runs[True][0])
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_mlp_rebuild_frees_down_inputs_and_changes_no_bit_of_a_step() -> None:
    got = run_interpreted(_WORKER, timeout_s=600)
    layers = 2
    assert got["flags False"] == [False] and got["flags True"] == [True], got
    assert got["rebuilds False"] is False and got["rebuilds True"] is True
    assert got["alive False"] == [True] * layers, got["alive False"]  # kept for down_proj's backward
    assert got["alive True"] == [False] * layers, got["alive True"]  # rebuilt there instead
    assert got["flags True recompute"] == [False] and got["flags True again"] == [True]
    assert got["flags False recompute"] == [False] and got["flags False again"] == [False]
    assert got["steps"] == 3 and got["same losses"] and got["same adapters"], got
