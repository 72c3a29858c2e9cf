"""The LoRA term folded into cuBLAS's base GEMMs by concatenating along K, measured in the real graphed
step before anything is built (issue 40: the 200-step task's 2-job steps need ~12% more).

Today the 14336-wide GEMMs run as a Triton persistent GEMM with the LoRA epilogue (~600-650 TFLOP/s against
cuBLAS's ~700-760 on the same shapes, session 57), the others as cuBLAS plus a LoRA store pass, and every
LoRA shrink and weight gradient as a Triton pass. The K-concatenated form ("kconcat") keeps every GEMM in
cuBLAS and gives the expand no pass of its own. Per linear, one buffer E [d_out + R, d_in + R] holds the
frozen W in its corner, the step's B_j as spare columns and its A_j as spare rows (R = 64 a job slot):

    forward   S   = X A_all^T                 [M, R]  (every row against every slot; cuBLAS)
              S_b = where(row in slot j and col < r_j, s_j S, 0)      (block-diagonal by job)
              Y   = [X | S_b] @ [W | B_all]^T                         (cuBLAS, K = d_in + R)
    backward  dS_b = where(..., s_j dY B_all, 0)
              dX  = [dY | dS_b] @ [W ; A_all]                         (cuBLAS, K = d_out + R)
              dA_all = dS_b^T X,  dB_all^T = S_b^T dY                 (cuBLAS; added into the grad arena)

The jobs' A and B^T are copied from the adapter arena into E at each linear's forward (inside the graph),
and their gradients added back into the grad arena: the same arena, optimizer, step graphs and report as
the product, only MultiLoraLinear's forward swapped (here, in this script). Forms, each in the same
process, on the same engine (`bench/host_profile.py`'s: 2 jobs, r16 batch 1 + r64 batch 4, ~`--tokens`
tokens a sample, recompute off):

- `product`: the product's own form (fused / auto, as shipped);
- `kconcat`: the form above;
- `base`:    the backbone alone: each linear a plain cuBLAS GEMM (no LoRA term, the jobs' gradients zero):
             the floor any LoRA form sits on.

Check (same run): one eager forward and backward on one batch with random A and B in both forms: each job's
loss and its gradient blocks (relative norm of the difference) against the product's form, both bf16.

    python bench/kconcat_step.py [--layers 32] [--tokens 290] [--forms product,kconcat,base,product,kconcat]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_profile import attach_pair, build, measure, samples  # noqa: E402

from trainer.multilora import MultiLoraLinear  # noqa: E402
from trainer.step_graphs import StepGraphs  # noqa: E402

SLOT = 64  # spare rows / columns of E a job slot


class KForm:
    """Every linear's E buffer and the fixed jobs' arena blocks (host ints: this bench's jobs never
    change, so their arena offsets do not either); the step's masks, once per StepLayout."""

    def __init__(self, eng, states) -> None:  # noqa: ANN001
        ints = eng.slots.layout_offsets(states)
        n_lin, n = len(eng.layer_list), len(states)
        self.n, self.r = n, SLOT * n
        self.mode = "product"
        self.layers: dict[MultiLoraLinear, tuple] = {}
        for k, layer in enumerate(eng.layer_list):
            w = layer.base.weight
            d_out, d_in = w.shape
            e = torch.zeros(d_out + self.r, d_in + self.r, dtype=w.dtype, device=w.device)
            e[:d_out, :d_in].copy_(w)
            jobs = [(s.adapter.rank, ints[k * n + j], ints[n_lin * n + k * n + j]) for j, s in enumerate(states)]
            self.layers[layer] = (e, jobs, d_in, d_out)
        self._lay, self._masks = None, None

    def masks(self, lay, m: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        """[M, R] bool: row in slot j's rows and column a live rank column of slot j; [M, 1] the row's scale."""
        if lay is not self._lay or self._masks is None or self._masks[0].shape[0] != m:
            dev = lay.offsets.device
            rows = torch.arange(m, device=dev)[:, None]
            in_job = (rows >= lay.offsets[: self.n][None]) & (rows < lay.offsets[1 : self.n + 1][None])  # [M, n]
            col = torch.arange(self.r, device=dev)
            slot = col // SLOT
            live = (col % SLOT) < lay.ranks[: self.n].to(torch.int64)[slot]
            mask = in_job[:, slot] & live[None]
            scale = (in_job.to(torch.float32) @ lay.scales[: self.n].to(torch.float32))[:, None]
            self._lay, self._masks = lay, (mask, scale)
        return self._masks


class _KConcat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token, e, d_in, d_out, r, mask, scale, grad_arena, jobs):  # noqa: ANN001, D102
        s_all = x @ e[d_out:, :d_in].t()
        s_b = torch.where(mask, (s_all.float() * scale).to(x.dtype), 0)
        xs = torch.cat([x, s_b], 1)
        y = xs @ e[:d_out].t()
        ctx.save_for_backward(xs, e, mask, scale)
        ctx.meta = (d_in, d_out, r, grad_arena, jobs)
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, D102
        xs, e, mask, scale = ctx.saved_tensors
        d_in, d_out, r, g, jobs = ctx.meta
        dy = dy.contiguous()
        ds_b = torch.where(mask, ((dy @ e[:d_out, d_in:]).float() * scale).to(dy.dtype), 0)
        dx = torch.cat([dy, ds_b], 1) @ e[:, :d_in] if ctx.needs_input_grad[0] else None
        x, s_b = xs[:, :d_in], xs[:, d_in:]
        da = ds_b.t() @ x       # [R, d_in]
        dbt = s_b.t() @ dy      # [R, d_out]
        for j, (rank, ao, bo) in enumerate(jobs):
            g[ao : ao + rank * d_in].view(rank, d_in).add_(da[j * SLOT : j * SLOT + rank])
            g[bo : bo + rank * d_out].view(rank, d_out).add_(dbt[j * SLOT : j * SLOT + rank])
        return dx, None, None, None, None, None, None, None, None, None


class _Base(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token, w):  # noqa: ANN001, D102
        ctx.save_for_backward(w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, D102
        (w,) = ctx.saved_tensors
        return (dy @ w if ctx.needs_input_grad[0] else None), None, None


FORM: list[KForm] = []
_PRODUCT_FORWARD = MultiLoraLinear.forward


def _forward(self: MultiLoraLinear, x: torch.Tensor) -> torch.Tensor:
    form = FORM[0] if FORM else None
    lay = self.layout
    if form is None or form.mode == "product" or lay is None or self.a_off is None or self.dense is not None:
        return _PRODUCT_FORWARD(self, x)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    e, jobs, d_in, d_out = form.layers[self]
    if form.mode == "base":
        y = _Base.apply(x2, lay.token, e[:d_out, :d_in])
    else:
        for j, (rank, ao, bo) in enumerate(jobs):  # this step's A and B^T into E's spare rows and columns
            e[d_out + j * SLOT : d_out + j * SLOT + rank, :d_in].copy_(lay.arena[ao : ao + rank * d_in].view(rank, d_in))
            e[:d_out, d_in + j * SLOT : d_in + j * SLOT + rank].copy_(
                lay.arena[bo : bo + rank * d_out].view(rank, d_out).t())
        mask, scale = form.masks(lay, x2.shape[0])
        y = _KConcat.apply(x2, lay.token, e, d_in, d_out, form.r, mask, scale, lay.grad_arena, jobs)
    return y.reshape(*shape[:-1], d_out)


def _base_forward(self: MultiLoraLinear, x: torch.Tensor) -> torch.Tensor:
    """The backbone alone in place of the operator (the `base` form without E buffers): its linear by cuBLAS, no
    LoRA term, the jobs' gradients left zero. Bias-free models only (a bench's Llama shape)."""
    lay = self.layout
    if lay is None or self.a_off is None or self.dense is not None:
        return _PRODUCT_FORWARD(self, x)
    assert self.base.bias is None, "the base form is for bias-free linears"
    shape = x.shape
    return _Base.apply(x.reshape(-1, shape[-1]), lay.token, self.base.weight).reshape(*shape[:-1], self.out_features)


def use_base_form() -> None:
    """Every MultiLoraLinear of this process runs `_base_forward` (bench/executor_task.py --lora-form base: the
    task's pace were the LoRA term free; its evaluations see no adapter, so its early exit ranks ties)."""
    MultiLoraLinear.forward = _base_forward


def check(eng, form: KForm) -> str:  # noqa: ANN001
    """One eager forward and backward of one batch in the product's form and in kconcat, A and B random."""
    states = list(eng.jobs.values())
    eng.step_graphs = None
    g = torch.Generator(device=eng.slots.arena.device).manual_seed(5)
    eng.slots.arena.copy_(torch.randn(eng.slots.arena.shape, generator=g, device=eng.slots.arena.device) * 0.02)
    per_job = [[eng.train_examples[i] for i in range(k * 8, k * 8 + s.spec.batch_size)] for k, s in enumerate(states)]
    out = {}
    for mode in ("product", "kconcat"):
        form.mode = mode
        eng.set_recompute(False)
        _, numbers = eng._eager_forward_backward(states, per_job)
        out[mode] = ([float(n.reshape(-1)[0]) for n in numbers],
                     [eng.slots.grad_arena[slice(*eng.slots.regions[s.job_id])].clone() for s in states])
    form.mode = "product"
    parts = []
    for j, s in enumerate(states):
        lp, lk = out["product"][0][j], out["kconcat"][0][j]
        gp, gk = out["product"][1][j], out["kconcat"][1][j]
        rel = float((gk - gp).norm() / gp.norm().clamp(min=1e-30))
        parts.append(f"job {s.job_id} (r{s.adapter.rank}): loss {lp:.5f} / {lk:.5f} (rel {abs(lk - lp) / abs(lp):.1e}), "
                     f"gradient rel. diff {rel:.1e}, norm {float(gp.norm()):.3e}")
    return "; ".join(parts)


def tiny_cpu_engine():  # noqa: ANN201
    """host_profile.build's engine on the CPU: 2 layers of a 64-wide Llama in float32, the same 2 jobs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.engine import MultiLoraEngine

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg)
    eng = MultiLoraEngine(model, samples(32, 10, 40, 0, 256), 0, gradient_checkpointing=False, attention="varlen")
    attach_pair(eng)
    return eng


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=290)
    ap.add_argument("--forms", default="product,kconcat,base,product,kconcat")
    ap.add_argument("--warmup", type=int, default=24)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny float32 model: the check alone")
    args = ap.parse_args()
    t0 = time.perf_counter()
    eng = tiny_cpu_engine() if args.smoke else build(args.layers, False, args.tokens)
    form = KForm(eng, list(eng.jobs.values()))
    FORM.append(form)
    MultiLoraLinear.forward = _forward
    print(f"built in {time.perf_counter() - t0:.1f} s; E buffers {sum(v[0].numel() for v in form.layers.values()) * 2 / 2**30:.1f} GiB",
          flush=True)
    checked = check(eng, form)
    print("check:", checked, flush=True)
    if args.smoke:
        return
    rows, kernels = [], []
    for i, mode in enumerate(args.forms.split(",")):
        form.mode = mode
        eng.set_recompute(False)
        eng.step_graphs = StepGraphs(eng)
        m = measure(eng, args.warmup, args.iters)
        row = (f"| {i + 1} | {mode} | {m['wall_ms']:.1f} | {m['tokens']:.0f} | {m['tokens'] / m['wall_ms'] * 1e3:,.0f} | "
               f"{m['traced_wall_ms']:.1f} / {m['traced_ms']:.1f} | {m['replay']} | {m['graphs']} |")
        rows.append(row)
        print(row, flush=True)
        top = sorted((e for e in m["events"] if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: -e.self_device_time_total)[:14]
        kernels.append(f"### run {i + 1} ({mode}): the 3 profiled steps' kernels, ms a step\n\n| kernel | calls a step | ms a step |\n|---|---|---|\n"
                       + "\n".join(f"| {e.key[:70]} | {e.count / 3:.0f} | {e.self_device_time_total / 3e3:.2f} |" for e in top) + "\n")
        eng.step_graphs = None
        torch.cuda.synchronize()
    med = {mode: statistics.median(float(r.split("|")[3]) for r in rows if r.split("|")[2].strip() == mode)
           for mode in dict.fromkeys(args.forms.split(","))}
    text = "\n".join([
        f"# The K-concatenated LoRA form in the graphed step ({torch.cuda.get_device_name()}, {args.layers} layers of "
        f"the Llama-3.1-8B shape, random bf16 weights, 2 jobs: r16 b1 + r64 b4, ~{args.tokens} tokens a sample, "
        "recompute off, CUDA graphs)", "",
        f"Check (one eager step, A and B random, kconcat against the product's form, both bf16): {checked}", "",
        "Each run: its own step graphs, then host_profile.measure: the median of "
        f"{args.iters} synced steps after {args.warmup}; traced = 3 more steps' wall / device busy (union of "
        "intervals); replays back to back at each captured key's last fill.", "",
        "| run | form | step wall ms (median) | tokens | tok/s | traced wall / busy ms | back-to-back replays | graph counts |",
        "|---|---|---|---|---|---|---|---|", *rows, "",
        "Median step wall by form: " + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items()), "", *kernels])
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
