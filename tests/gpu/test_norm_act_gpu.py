"""The fused RMSNorm, SiLU-gate and rotary kernels on CUDA (kernels.norm_act, kernels.rope,
trainer.fused_blocks): in bfloat16 within one ulp of transformers' own modules forward (the rotary
embedding as close to a float64 oracle as its function, both ways), their gradients as close to a
float64 oracle as the modules' own, less memory kept for the backward, and an engine step on a
fused backbone equal to the unfused one. Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from kernels.norm_act import rms_norm, silu_mul  # noqa: E402
from kernels.rope import rope, rope_applies  # noqa: E402
from tests.unit.test_step_graphs import examples, job  # noqa: E402
from trainer.engine import MultiLoraEngine  # noqa: E402
from trainer.fused_blocks import use_fused_rope  # noqa: E402


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    unit = torch.ldexp(torch.ones_like(b), torch.frexp(b).exponent - 8)
    return ((a - b).abs() / unit).max().item()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_rms_norm_matches_the_llama_module_and_its_gradient() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(4096, eps=1e-5).cuda().to(torch.bfloat16).requires_grad_(False)
    norm.weight.copy_(torch.randn(4096) * 0.2 + 1)
    x = (torch.randn(3000, 4096, device="cuda") * 3 + 0.2).to(torch.bfloat16)
    dy = torch.randn_like(x)
    assert _ulps(rms_norm(x, norm.weight, 1e-5), norm(x)) <= 1
    xo = x.double().requires_grad_()
    w = norm.weight.double()
    (w * xo * torch.rsqrt(xo.pow(2).mean(-1, keepdim=True) + 1e-5)).backward(dy.double())
    grads = []
    for fn in (lambda t: rms_norm(t, norm.weight, 1e-5), norm):
        t = x.clone().requires_grad_()
        fn(t).backward(dy)
        grads.append(_rel(t.grad, xo.grad))
    assert grads[0] <= 1.5 * grads[1] + 1e-4, grads


def test_silu_gate_matches_the_mlp_ops_and_its_gradient() -> None:
    torch.manual_seed(1)
    g, u, dh = (torch.randn(2000, 14336, device="cuda").mul(3).to(torch.bfloat16) for _ in range(3))
    assert _ulps(silu_mul(g, u), torch.nn.functional.silu(g) * u) <= 1
    go, uo = g.double().requires_grad_(), u.double().requires_grad_()
    (torch.nn.functional.silu(go) * uo).backward(dh.double())
    errs = []
    for fn in (silu_mul, lambda a, b: torch.nn.functional.silu(a) * b):
        a, b = g.clone().requires_grad_(), u.clone().requires_grad_()
        fn(a, b).backward(dh)
        errs.append((_rel(a.grad, go.grad), _rel(b.grad, uo.grad)))
    assert errs[0][0] <= 1.5 * errs[1][0] + 1e-4 and errs[0][1] <= 1.5 * errs[1][1] + 1e-4, errs


def test_rope_is_as_close_to_float64_as_the_llama_function_both_ways() -> None:
    """The 8B shape's heads (32 query, 8 key of 128) as transposed views of the projections, cos and
    sin from Llama's own rotary module over packed positions (three sequences back to back): the
    outputs and both gradients at least as close to a float64 oracle as transformers' function."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as ml

    own = getattr(ml.apply_rotary_pos_emb, "loraplex_own", ml.apply_rotary_pos_emb)
    torch.manual_seed(2)
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)
    length = 700
    x = torch.randn(1, length, 4096, device="cuda", dtype=torch.bfloat16)
    positions = torch.cat([torch.arange(n, device="cuda") for n in (300, 250, 150)])[None]
    cos, sin = ml.LlamaRotaryEmbedding(cfg)(x, positions)
    q, k = (torch.randn(1, length, h * 128, device="cuda", dtype=torch.bfloat16).view(1, length, h, 128).transpose(1, 2)
            for h in (32, 8))
    assert rope_applies(q, k, cos, sin)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    outs = {}
    for name, fn, dt in (("kernel", rope, None), ("own", own, None), ("oracle", own, torch.float64)):
        qa, ka = (t.detach().to(dt or t.dtype).requires_grad_() for t in (q, k))
        c, s_ = (t.to(dt or t.dtype) for t in (cos, sin))
        y = fn(qa, ka, c, s_)
        torch.autograd.backward(y, (gq.to(y[0].dtype), gk.to(y[1].dtype)))
        outs[name] = [y[0], y[1], qa.grad, ka.grad]
    for got, own_out, oracle in zip(outs["kernel"], outs["own"], outs["oracle"], strict=True):
        assert got.dtype == torch.bfloat16 and got.shape == own_out.shape
        assert _rel(got, oracle) <= _rel(own_out, oracle) + 1e-6, (_rel(got, oracle), _rel(own_out, oracle))
    assert outs["kernel"][0].stride() == q.stride() and outs["kernel"][1].stride() == k.stride()


def _engine(monkeypatch, fused: bool) -> MultiLoraEngine:  # noqa: ANN001
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=1024, intermediate_size=3584, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).requires_grad_(False)
    with monkeypatch.context() as m:
        m.setenv("LORAPLEX_FUSED_BLOCKS", "1" if fused else "0")
        return MultiLoraEngine(model, examples(48, 512), 0, gradient_checkpointing=False, attention="varlen",
                               step_graphs=False)


def test_a_fused_engine_step_equals_the_unfused_one_and_keeps_less(monkeypatch) -> None:  # noqa: ANN001
    engines = {name: _engine(monkeypatch, name == "fused") for name in ("fused", "plain")}
    assert engines["fused"].fused_blocks["mlps"] == 2 and engines["fused"].fused_blocks["norms"] == 5
    assert engines["plain"].fused_blocks["mlps"] == 0 and engines["fused"].fused_blocks["ropes"] == 2
    peaks, losses = {}, {}
    try:
        for name, eng in engines.items():
            use_fused_rope(name == "fused")  # the rotary swap is the process's
            for spec in (job("a", 8, 4, 1), job("b", 16, 4, 2)):
                eng.attach(spec)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            losses[name] = [eng.step().losses for _ in range(3)]
            peaks[name] = torch.cuda.max_memory_allocated() - base
    finally:
        use_fused_rope(True)
    for want, got in zip(losses["plain"], losses["fused"], strict=True):
        for j, v in want.items():
            assert abs(got[j] - v) <= 2e-3 * abs(v), (j, got[j], v)
    # per token and layer the fused blocks keep about (intermediate + hidden) x 2 bytes less
    assert peaks["fused"] < peaks["plain"], peaks
