"""Could every LoRA pass of a small step be a cuBLAS GEMM? A probe of the "concatenated" design (issue 40).

A replayed 2-job step of ~1,450 tokens at 32 layers of the Llama-3.1-8B shape spends ~18 ms in the LoRA's own
kernels (shrinks 8.2 ms, store passes 5.4 ms, weight gradients 4.8 ms; bench/results/session61_h200.md) for
~11 GB of bytes (~2.3 ms at the H200's bandwidth): small kernels bound by their chains of dependent loads.

The design probed here puts every job's LoRA factors beside the frozen weight in one buffer
W_ext [d_out + R_cap, d_in + R_cap] (W top left, the jobs' stacked A [R, d_in] below it, their stacked B^T
[d_out, R] right of it, R the step's summed ranks), so that:

- forward: [y | S] = x @ W_ext[:d_out + R, :d_in]^T (the base GEMM gives every job's shrink; the R extra columns
  mostly fall in the GEMM's last partial tile); S_m = S * M (M [T, R]: row t's own job's columns at its
  scale, zero elsewhere, built once a step); y += S_m @ B_all (cuBLAS, beta = 1);
- backward: [dX | dS] = dY @ W_ext[:d_out, :d_in + R] (the dX GEMM gives every dS); dS_m = dS * M;
  dX += dS_m @ A_all; dA_all = dS_m^T X; dB_all = S_m^T dY (cuBLAS).

A step would copy the arena's factors into W_ext (they change at every update) and add the gradients back into
the gradient arena. This script times one layer's seven linears (q, k, v, o, gate, up, down), forward and
backward, replayed as one CUDA graph, three ways:

- `fused`: today's operator (kernels.fused_lora.multilora_linear_arena_fused, the process's GEMM variant);
- `concat`: the design's GEMMs alone (the factors already in W_ext, gradients added to per-linear buffers);
- `concat+copies`: with the per-step copies in (gathers into W_ext, index_add_ into the gradient arena);
- `rows`: only the forward's shrink from the base GEMM (W_rows = [W; A_all], rows contiguous, W itself a
  contiguous view), the backward's dS its own GEMM dY @ B_all^T (B_all in a staging [R_cap, d_out]);
- `rows+foreach`: `rows` with its copies, all between contiguous blocks: the factors in by one multi-tensor copy
  per graph, the float32 gradients (cuBLAS's bf16 -> fp32 GEMMs) out by one multi-tensor add (a step would make
  one of each for all its layers; here each layer's graph has its own);
- `stage`: W untouched, every LoRA pass a cuBLAS GEMM on staged A_all and B_all (the shrink its own GEMM, y and
  dX contiguous), with `rows+foreach`'s copies;
- `base`: the frozen GEMMs alone (no LoRA), the floor (its numbers are not checked: they lack the LoRA term).

Every form's outputs, dX, dA and dB are checked against a float64 reference of the same numbers. CUDA only.

    python bench/lora_concat.py [--tokens 1440] [--ranks 16,64] [--share 0.2,0.8] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_timing import replay_ms  # noqa: E402

SHAPES = (("q", 4096, 4096), ("k", 4096, 1024), ("v", 4096, 1024), ("o", 4096, 4096), ("gate", 4096, 14336),
          ("up", 4096, 14336), ("down", 14336, 4096))
CAP = 512  # R_cap: the spare rows and columns of W_ext
DEV = "cuda"  # a CPU check of the design's numbers may set "cpu" (the timing needs CUDA graphs)


class Layer:
    """One linear's numbers in both layouts: the arena (fused) and W_ext (concat)."""

    def __init__(self, d_in: int, d_out: int, counts: list[int], ranks: list[int], g: torch.Generator) -> None:
        dev, bf = DEV, torch.bfloat16
        self.d_in, self.d_out, self.r = d_in, d_out, sum(ranks)
        self.w = (torch.randn(d_out, d_in, device=dev, generator=g) * d_in ** -0.5).to(bf)
        self.a = [(torch.randn(r, d_in, device=dev, generator=g) * d_in ** -0.5).to(bf) for r in ranks]
        self.b = [(torch.randn(r, d_out, device=dev, generator=g) * r ** -0.5).to(bf) for r in ranks]
        # the arena: each job's A [r, d_in] then B [r, d_out], 16-element aligned blocks
        pieces, a_off, b_off, pos = [], [], [], 0
        for a, b in zip(self.a, self.b, strict=True):
            for t, offs in ((a, a_off), (b, b_off)):
                offs.append(pos)
                pieces.append(t.reshape(-1))
                pos += t.numel()
                pad = -pos % 16
                pieces.append(torch.zeros(pad, device=dev, dtype=bf))
                pos += pad
        self.arena = torch.cat(pieces)
        self.grad = torch.zeros(self.arena.numel(), device=dev, dtype=torch.float32)
        self.a_off = torch.tensor(a_off, device=dev)
        self.b_off = torch.tensor(b_off, device=dev)
        # W_ext and the flat arena positions of its factor regions (row-major [R, d_in] and [R, d_out])
        self.wext = torch.zeros(d_out + CAP, d_in + CAP, device=dev, dtype=bf)
        self.wext[:d_out, :d_in] = self.w
        ia, ib = [], []
        for r, ao, bo in zip(ranks, a_off, b_off, strict=True):
            ia.append(ao + torch.arange(r * d_in, device=dev))
            ib.append(bo + torch.arange(r * d_out, device=dev))
        self.idx_a, self.idx_b = torch.cat(ia), torch.cat(ib)
        self.fill_ext()
        self.ga = torch.zeros(self.r, d_in, device=dev)  # concat: the gradients before they reach the arena
        self.gb = torch.zeros(self.r, d_out, device=dev)
        # the "rows" layout: W_rows [d_out + R_cap, d_in] (W, then the jobs' A rows: contiguous blocks) and a
        # staging B_all [R_cap, d_out]; the per-job views the copies go between
        self.wrows = torch.zeros(d_out + CAP, d_in, device=dev, dtype=bf)
        self.wrows[:d_out] = self.w
        self.bstage = torch.zeros(CAP, d_out, device=dev, dtype=bf)
        self.astage = torch.zeros(CAP, d_in, device=dev, dtype=bf)  # the "stage" variant's A_all
        self.dst, self.stage_dst, self.src, self.grad_dst = [], [], [], []
        row = 0
        for r, ao, bo in zip(ranks, a_off, b_off, strict=True):
            self.dst += [self.wrows[d_out + row:d_out + row + r], self.bstage[row:row + r]]
            self.stage_dst += [self.astage[row:row + r], self.bstage[row:row + r]]
            self.src += [self.arena[ao:ao + r * d_in].view(r, d_in), self.arena[bo:bo + r * d_out].view(r, d_out)]
            self.grad_dst += [self.grad[ao:ao + r * d_in].view(r, d_in), self.grad[bo:bo + r * d_out].view(r, d_out)]
            row += r
        torch._foreach_copy_(self.dst, self.src)
        torch._foreach_copy_(self.stage_dst, self.src)
        self.da = self.db = None  # "rows+foreach": the step's float32 gradients, added to the arena after

    def fill_ext(self) -> None:
        """The arena's factors into W_ext: A_all below W, B_all^T right of it."""
        r, d_in, d_out = self.r, self.d_in, self.d_out
        self.wext[d_out:d_out + r, :d_in].copy_(self.arena[self.idx_a].view(r, d_in))
        self.wext[:d_out, d_in:d_in + r].copy_(self.arena[self.idx_b].view(r, d_out).t())


class ConcatFn(torch.autograd.Function):
    """The design's forward and backward for one linear (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, layer, mask, copies):  # noqa: ANN001, D102
        d_in, d_out, r, wext = layer.d_in, layer.d_out, layer.r, layer.wext
        if copies:
            layer.fill_ext()
        return _folded_forward(ctx, x, layer, mask, copies, wext[:d_out + r, :d_in], wext[:d_out, d_in:d_in + r].t())

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, D102
        x, s, mask = ctx.saved_tensors
        layer = ctx.layer
        d_in, d_out, r, wext = layer.d_in, layer.d_out, layer.r, layer.wext
        dx_ext = dy @ wext[:d_out, :d_in + r]
        ds = dx_ext[:, d_in:] * mask
        dx = dx_ext[:, :d_in]
        dx.addmm_(ds, wext[d_out:d_out + r, :d_in])
        da, db = ds.t() @ x, s.t() @ dy
        if ctx.copies:  # into the gradient arena at the jobs' blocks
            layer.grad.index_add_(0, layer.idx_a, da.reshape(-1).float())
            layer.grad.index_add_(0, layer.idx_b, db.reshape(-1).float())
        else:
            layer.ga.add_(da)
            layer.gb.add_(db)
        return dx, None, None, None


def _folded_forward(ctx, x: torch.Tensor, layer: Layer, mask: torch.Tensor, copies: bool, w_ext: torch.Tensor,  # noqa: ANN001
                    b_all: torch.Tensor) -> torch.Tensor:
    """`concat` and `rows`' forward: [y | S] = x @ w_ext^T (w_ext: W then A_all), y += (S * M) @ b_all."""
    y_ext = x @ w_ext.t()
    s = y_ext[:, layer.d_out:] * mask
    y = y_ext[:, :layer.d_out]
    y.addmm_(s, b_all)
    ctx.save_for_backward(x, s, mask)
    ctx.layer, ctx.copies = layer, copies
    return y


class StageFn(torch.autograd.Function):
    """The "stage" variant: W untouched; every LoRA pass a cuBLAS GEMM on staged A_all [R_cap, d_in] and
    B_all [R_cap, d_out] (the shrink x @ A_all^T its own GEMM; y and dX contiguous)."""

    @staticmethod
    def forward(ctx, x, layer, mask, copies):  # noqa: ANN001, D102
        r = layer.r
        y = x @ layer.w.t()
        s = (x @ layer.astage[:r].t()) * mask
        y.addmm_(s, layer.bstage[:r])
        ctx.save_for_backward(x, s, mask)
        ctx.layer, ctx.copies = layer, copies
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, D102
        layer = ctx.layer
        return _separate_backward(ctx, dy, layer.w, layer.astage[:layer.r], True), None, None, None


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated and stored in float32 (cuBLAS's bf16 -> fp32 GEMM on CUDA)."""
    return torch.mm(a, b, out_dtype=torch.float32) if a.is_cuda else (a @ b).float()


class RowsFn(torch.autograd.Function):
    """The "rows" variant: only the forward's shrink comes from the base GEMM (W_rows = [W; A_all], contiguous
    rows); the backward's dS is its own small GEMM dY @ B_all^T, so W itself stays a contiguous [d_out, d_in]."""

    @staticmethod
    def forward(ctx, x, layer, mask, copies):  # noqa: ANN001, D102
        return _folded_forward(ctx, x, layer, mask, copies, layer.wrows[:layer.d_out + layer.r], layer.bstage[:layer.r])

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, D102
        layer = ctx.layer
        d_out, r = layer.d_out, layer.r
        return _separate_backward(ctx, dy, layer.wrows[:d_out], layer.wrows[d_out:d_out + r], ctx.copies), \
            None, None, None


def _separate_backward(ctx, dy: torch.Tensor, w: torch.Tensor, a_all: torch.Tensor, wide: bool) -> torch.Tensor:  # noqa: ANN001
    """`rows` and `stage`'s backward: dX = dY W + ((dY B_all^T) * M) A_all, dS its own GEMM; dA_all and dB_all
    in float32 for the multi-tensor add (`wide`), else added to the linear's own buffers."""
    x, s, mask = ctx.saved_tensors
    layer = ctx.layer
    dx = dy @ w
    ds = (dy @ layer.bstage[:layer.r].t()) * mask
    dx.addmm_(ds, a_all)
    if wide:
        layer.da, layer.db = _mm32(ds.t(), x), _mm32(s.t(), dy)
    else:
        layer.ga.add_(ds.t() @ x)
        layer.gb.add_(s.t() @ dy)
    return dx


def mask_of(counts: list[int], ranks: list[int], scales: list[float], t: int) -> torch.Tensor:
    """M [T, R]: row t's own job's rank columns at the job's scale, zero elsewhere (padding rows: zero)."""
    m = torch.zeros(t, sum(ranks), device=DEV, dtype=torch.bfloat16)
    row = col = 0
    for c, r, s in zip(counts, ranks, scales, strict=True):
        m[row:row + c, col:col + r] = s
        row, col = row + c, col + r
    return m


def run(form: str, layers: list[Layer], xs: list[torch.Tensor], dys: list[torch.Tensor], mask: torch.Tensor,
        meta: dict) -> list[tuple[torch.Tensor, ...]]:
    """One layer's seven linears, forward then backward, in `form`; returns each linear's (y, dx)."""
    from kernels.fused_lora import multilora_linear_arena_fused

    ys, leaves = [], []
    if form == "rows+foreach":  # the arena's factors into W_rows and the staging B: one multi-tensor copy
        torch._foreach_copy_([d for layer in layers for d in layer.dst], [s for layer in layers for s in layer.src])
    if form == "stage":  # the arena's factors into the staging A and B: one multi-tensor copy
        torch._foreach_copy_([d for layer in layers for d in layer.stage_dst],
                             [s for layer in layers for s in layer.src])
    for layer, x in zip(layers, xs, strict=True):
        xx = x.detach().requires_grad_()
        leaves.append(xx)
        if form == "fused":
            ys.append(multilora_linear_arena_fused(xx, layer.w, None, layer.arena, layer.grad, layer.a_off,
                                                   layer.b_off, meta["scales"], meta["ranks"], meta["offsets"],
                                                   meta["r_max"], meta["token"], aligned=True))
        elif form == "base":
            ys.append(xx @ layer.w.t())
        elif form == "stage":
            ys.append(StageFn.apply(xx, layer, mask, True))
        elif form.startswith("rows"):
            ys.append(RowsFn.apply(xx, layer, mask, form == "rows+foreach"))
        else:
            ys.append(ConcatFn.apply(xx, layer, mask, form == "concat+copies"))
    grads = torch.autograd.grad(ys, leaves, dys)
    if form in ("rows+foreach", "stage"):  # every job's gradient rows into the gradient arena: one multi-tensor add
        torch._foreach_add_([d for layer in layers for d in layer.grad_dst],
                            [g[row:row + len(d)] for layer in layers
                             for g, row, d in _grad_rows(layer)])
    return [(y.detach(), g) for y, g in zip(ys, grads, strict=True)]


def _grad_rows(layer: Layer) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """(the step's dA or dB of all jobs, the job's first row, the job's arena view) in grad_dst's order."""
    out, row = [], 0
    for k in range(0, len(layer.grad_dst), 2):
        a_view, b_view = layer.grad_dst[k], layer.grad_dst[k + 1]
        out += [(layer.da, row, a_view), (layer.db, row, b_view)]
        row += a_view.shape[0]
    return out


def reference(layer: Layer, x: torch.Tensor, dy: torch.Tensor, counts: list[int], ranks: list[int],
              scales: list[float]) -> dict[str, torch.Tensor]:
    """float64: y, dX, dA_all, dB_all of one linear."""
    d = torch.float64
    x, dy, w = x.to(d), dy.to(d), layer.w.to(d)
    y, dx = x @ w.t(), dy @ w
    da, db, row = [], [], 0
    for c, a, b, s in zip(counts, layer.a, layer.b, scales, strict=True):
        a, b = a.to(d), b.to(d)
        xs, dys = x[row:row + c], dy[row:row + c]
        sj = xs @ a.t() * s
        y[row:row + c] += sj @ b
        dsj = dys @ b.t() * s
        dx[row:row + c] += dsj @ a
        da.append(dsj.t() @ xs)
        db.append(sj.t() @ dys)
        row += c
    return {"y": y, "dx": dx, "dA": torch.cat(da), "dB": torch.cat(db)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1440)
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--share", default="0.2,0.8", help="each job's share of the rows")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    shares = [float(s) for s in args.share.split(",")]
    counts = [int(args.tokens * s) for s in shares]
    counts[-1] += args.tokens - sum(counts)
    scales = [2.0] * len(ranks)  # alpha = 2 r
    t = args.tokens
    g = torch.Generator(device=DEV).manual_seed(0)
    layers = [Layer(d_in, d_out, counts, ranks, g) for _, d_in, d_out in SHAPES]
    xs = [torch.randn(t, d_in, device=DEV, generator=g).to(torch.bfloat16) for _, d_in, _ in SHAPES]
    dys = [torch.randn(t, d_out, device=DEV, generator=g).to(torch.bfloat16) * 0.01 for _, _, d_out in SHAPES]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device=DEV)
    meta = {"scales": torch.tensor(scales, device=DEV), "ranks": torch.tensor(ranks, device=DEV, dtype=torch.int32),
            "offsets": offsets, "r_max": max(ranks), "token": torch.zeros((), device=DEV, requires_grad=True)}
    mask = mask_of(counts, ranks, scales, t)
    lines = [f"# One layer's seven LoRA linears, forward + backward, as a CUDA graph ({torch.cuda.get_device_name()})",
             "", f"{t} rows; jobs: ranks {ranks}, rows {counts}; bf16; R_cap {CAP}; median of {args.iters} replays. "
             "Errors: relative (Frobenius) against float64, the worst of the seven linears.", "",
             "| form | ms a layer | x 32 layers ms | y err | dX err | dA err | dB err |", "|---|---|---|---|---|---|---|"]
    refs = [reference(layer, x, dy, counts, ranks, scales) for layer, x, dy in zip(layers, xs, dys, strict=True)]
    for form in ("base", "fused", "concat", "concat+copies", "rows", "rows+foreach", "stage"):
        errs = {"y": 0.0, "dx": 0.0, "dA": 0.0, "dB": 0.0}
        for i, layer in enumerate(layers):  # one linear's check at a time: gradients from zero
            layer.grad.zero_()
            layer.ga.zero_()
            layer.gb.zero_()
            out = run(form, [layer], [xs[i]], [dys[i]], mask, meta)[0]
            errs["y"] = max(errs["y"], rel(out[0], refs[i]["y"]))
            errs["dx"] = max(errs["dx"], rel(out[1], refs[i]["dx"]))
            if form == "base":
                continue
            if form in ("concat", "rows"):
                da, db = layer.ga, layer.gb
            else:
                da = layer.grad[layer.idx_a].view(layer.r, layer.d_in)
                db = layer.grad[layer.idx_b].view(layer.r, layer.d_out)
            errs["dA"] = max(errs["dA"], rel(da, refs[i]["dA"]))
            errs["dB"] = max(errs["dB"], rel(db, refs[i]["dB"]))
        ms = replay_ms(functools.partial(run, form, layers, xs, dys, mask, meta), args.iters)
        errors = " | ".join(f"{errs[k]:.1e}" for k in ("y", "dx", "dA", "dB")) if form != "base" else "- | - | - | -"
        lines.append(f"| {form} | {ms:.3f} | {ms * 32:.1f} | {errors} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
