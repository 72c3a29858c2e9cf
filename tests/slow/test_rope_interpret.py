"""The fused rotary embedding (kernels.rope) and its swap into the families' attention
(trainer.fused_blocks) on CPU, run by Triton's interpreter (TRITON_INTERPRET=1) in a subprocess so
neither the flag nor the process-wide swap leaks into other tests.

- The kernel, forward and backward, in float32 against a float64 oracle (transformers' own ops):
  cos for every batch row or one for all, ragged head counts, a half width that is no power of
  two, one position (a decode step, cos of every batch row), none; in bfloat16 against the ops in
  bfloat16 within bfloat16's precision.
- `rope_applies` refuses the calls it does not compute (another unsqueeze dim, partial rotary
  widths, mixed dtypes, a cos that wants a gradient, a 3-d q).
- Every tiny family (trainer.tiny.FAMILIES) in eval mode: its loss and input gradient with the
  swapped function equal those with its own function; Llama-style families swap and the kernel
  runs in their forward; interleaved or fused-projection families keep their own.
"""
from __future__ import annotations

import pytest

from tests.helpers.interpreted import run_interpreted

pytest.importorskip("triton")

_WORKER = r"""
from kernels.rope import rope, rope_applies, rope_reference
def qk(bsz, hq, hk, length, dim, dtype):
    return [torch.randn(bsz, length, h * dim, dtype=dtype).view(bsz, length, h, dim).transpose(1, 2) for h in (hq, hk)]
def check(bsz, hq, hk, length, dim, cos_rows, dtype):
    q, k = qk(bsz, hq, hk, length, dim, dtype)
    cos, sin = (torch.randn(cos_rows, length, dim, dtype=dtype) for _ in range(2))
    gq, gk = torch.randn(bsz, hq, length, dim, dtype=dtype), torch.randn(bsz, hk, length, dim, dtype=dtype)
    qa, ka = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    ya = rope(qa, ka, cos, sin)
    torch.autograd.backward(ya, (gq, gk))
    if dtype == torch.float32:  # against float64
        qr, kr = q.double().requires_grad_(), k.double().requires_grad_()
        yr = rope_reference(qr, kr, cos.double(), sin.double())
    else:  # against the ops in the same dtype
        qr, kr = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        yr = rope_reference(qr, kr, cos, sin)
    torch.autograd.backward(yr, (gq.to(yr[0].dtype), gk.to(yr[1].dtype)))
    return {"applies": rope_applies(q, k, cos, sin), "q": rel(ya[0], yr[0]), "k": rel(ya[1], yr[1]),
            "dq": rel(qa.grad, qr.grad), "dk": rel(ka.grad, kr.grad),
            "strides": ya[0].stride() == q.stride() and ya[1].stride() == k.stride(), "dtype": str(ya[0].dtype)}
for case in [(2, 4, 2, 5, 16, 1), (2, 3, 1, 7, 12, 2), (1, 5, 5, 1, 8, 1), (3, 4, 1, 1, 10, 3), (3, 2, 2, 0, 16, 1)]:
    out[f"fp32 {case}"] = check(*case, torch.float32)
out["bf16"] = check(2, 4, 2, 9, 32, 1, torch.bfloat16)
# calls it does not take
q, k = qk(1, 2, 2, 4, 8, torch.float32)
cos, sin = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
out["refused"] = {
    "unsqueeze 2": rope_applies(q, k, cos, sin, 2),
    "partial": rope_applies(q[..., :4], k[..., :4], cos[..., :4], sin[..., :4]),
    "mixed dtype": rope_applies(q, k, cos.double(), sin.double()),
    "cos grad": rope_applies(q, k, cos.requires_grad_(), sin),
    "3-d q": rope_applies(q[0], k[0], cos, sin),
    "plain": rope_applies(q, k, cos.detach(), sin)}
# every tiny family: the swap changes nothing of its numbers
from transformers import AutoModelForCausalLM
import trainer.fused_blocks as fb
from trainer.tiny import FAMILIES, tiny_config
calls = [0]
kernel = fb.rope
def counted(*a):
    calls[0] += 1
    return kernel(*a)
fb.rope = counted
# the dispatcher binds a call by the function's own signature: keywords of the Llama form take the
# kernel; an argument the form lacks (an older signature's position_ids) or a bad call, the function
def old_form(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return rope_reference(q, k, cos, sin) if position_ids is None else (q, k)
dispatch = fb._rope_dispatcher(old_form)
q, k = qk(1, 2, 2, 4, 8, torch.float32)
cos, sin = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
counts = []
for call in (lambda: dispatch(q, k, cos, sin), lambda: dispatch(q=q, k=k, cos=cos, sin=sin, unsqueeze_dim=1),
             lambda: dispatch(q, k, cos, sin, None, 1), lambda: dispatch(q, k, cos, sin, position_ids=torch.arange(4)),
             lambda: dispatch(q, k, cos, sin, unsqueeze_dim=2)):
    before = calls[0]
    try:
        got = call()
    except Exception as exc:
        got = type(exc).__name__
    counts.append(calls[0] - before)
try:
    dispatch(q, k, cos, sin, None, 1, unsqueeze_dim=1)
    bad = "ran"
except TypeError:
    bad = "TypeError"
out["dispatch"] = {"kernel calls": counts, "bad call": bad}
for fam in FAMILIES:
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(tiny_config(fam, 256), dtype=torch.float32).eval()
    done = fb.fuse_blocks(model, force=True)
    ids = torch.randint(0, 256, (2, 12))
    got = {}
    for on in (False, True):
        fb.use_fused_rope(on)
        before = calls[0]
        emb = model.get_input_embeddings().weight.requires_grad_(True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        got[on] = (loss.item(), emb.grad.clone(), calls[0] - before)
        emb.grad = None
    out[f"family {fam}"] = {"ropes": done["ropes"], "kept": done["kept"], "loss": abs(got[True][0] - got[False][0]),
                            "grad": rel(got[True][1], got[False][1]), "calls": got[True][2], "calls_off": got[False][2]}
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fused_rope_under_interpreter() -> None:
    got = run_interpreted(_WORKER, timeout_s=900)
    for name, r in got.items():
        if name.startswith("fp32"):
            assert r["applies"] and r["strides"] and r["dtype"] == "torch.float32", (name, r)
            assert max(r[k] for k in ("q", "k", "dq", "dk")) <= 1e-6, (name, r)
    bf = got["bf16"]
    assert bf["applies"] and bf["strides"] and bf["dtype"] == "torch.bfloat16", bf
    # Triton's interpreter casts to bfloat16 by truncation (round to nearest on a GPU, where
    # tests/gpu/test_norm_act_gpu.py holds the kernel to the ops' bits): a product's last place
    # apart, which the sum's cancellation can make many of the result's; bfloat16's precision here
    assert max(bf[k] for k in ("q", "k", "dq", "dk")) <= 2e-2, bf
    assert got["refused"] == {"unsqueeze 2": False, "partial": False, "mixed dtype": False, "cos grad": False,
                              "3-d q": False, "plain": True}, got["refused"]
    # plain call, keywords, position_ids=None positionally: the kernel; position_ids given, or
    # another unsqueeze dim (refused by rope_applies): the function itself
    assert got["dispatch"] == {"kernel calls": [1, 1, 1, 0, 0], "bad call": "TypeError"}, got["dispatch"]
    layers = 2
    for name, r in got.items():
        if name.startswith("family"):
            assert r["loss"] <= 1e-6 * max(1.0, r["loss"]) and r["grad"] <= 1e-6, (name, r)
            assert r["calls_off"] == 0, (name, r)
            if r["ropes"]:
                assert r["ropes"] == layers, (name, r)
    for fam in ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "olmo2", "granite"):
        r = got[f"family {fam}"]
        assert r["ropes"] == layers and r["calls"] == layers, (fam, r)  # one call a layer, on the kernel
    for fam, cls in (("cohere", "CohereAttention"), ("glm", "GlmAttention")):  # interleaved rotary
        r = got[f"family {fam}"]
        assert r["ropes"] == 0 and cls in r["kept"] and r["calls"] == 0, (fam, r)
    assert got["family phi3"]["ropes"] == 0  # one fused qkv projection: not an attention it probes
