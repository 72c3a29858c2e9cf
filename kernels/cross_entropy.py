"""Cross-entropy of a chunk of the head's logits in one Triton kernel, read in their own dtype.

`cross_entropy_rows(logits, targets, grad, hits)` gives per row (token) the loss
`logsumexp(x) - x[target]` in float32 (0 where the target is `IGNORE`), optionally whether the
row's argmax is its target (the first maximal index, as torch.argmax), and optionally writes the
loss's gradient with respect to the logits, `softmax(x) - onehot(target)` (0 on an ignored row),
over the logits themselves, rounded to their dtype. That is what `F.cross_entropy(x.float(),
targets, reduction="none")` and its autograd give, where the engine made a float32 copy of every
chunk of [tokens, vocabulary] logits, a float32 log-softmax and, training, a float32 softmax
gradient and its cast back (issue 40: ~2.5-4 MB of memory traffic a token at a 128k vocabulary,
about 3% of an evaluation on an H100). Here one program per row reads its bf16 logits once for
the sums (an online logsumexp) and once more for the gradient.

Runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1, how the tests check it against
`F.cross_entropy`). The row count and vocabulary only size the grid and the loop: a new token count
compiles nothing, and every vocabulary a multiple of 16 shares the kernel.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU image has triton; the caller keeps torch's path
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
IGNORE = -100  # F.cross_entropy's ignore_index
BLOCK = 4096  # logits a program reads at a time
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def available(t: torch.Tensor) -> bool:
    """Whether the kernel can run on this tensor's device."""
    return triton is not None and (t.is_cuda or (_INTERPRET and t.device.type == "cpu"))


if triton is not None:
    @triton.jit(do_not_specialize=["n_cols", "stride_x"])
    def _ce_rows(X, T, LOSS, HIT, n_cols, stride_x, IGNORE_INDEX: tl.constexpr, GRAD: tl.constexpr,
                 HITS: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x
        target = tl.load(T + row)
        valid = target != IGNORE_INDEX
        lanes = tl.arange(0, BLOCK_V)
        # per lane: the running max, the sum of exp(x - max), and the first column holding the max
        m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_V,), tl.float32)
        first = tl.zeros((BLOCK_V,), tl.int64)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + lanes
            x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x, propagate_nan=tl.PropagateNan.ALL)
            # a lane with no column yet (-inf) adds nothing; a NaN anywhere makes the sum NaN
            s = (s * tl.where(m == m_new, 1.0, tl.exp(m - m_new))
                 + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new)))
            first = tl.where(x > m, cols.to(tl.int64), first)  # strictly larger: an earlier column keeps a tie
            m = m_new
        m_row = tl.max(m, 0)
        lse = m_row + tl.log(tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - m_row)), 0))
        x_t = tl.load(x_row + tl.where(valid, target, 0)).to(tl.float32)
        tl.store(LOSS + row, tl.where(valid, lse - x_t, 0.0))
        if HITS:
            arg = tl.min(tl.where(m == m_row, first, n_cols), 0)
            tl.store(HIT + row, tl.where(valid & (arg == target), 1.0, 0.0))
        if GRAD:
            for start in range(0, n_cols, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                mask = cols < n_cols
                x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
                g = tl.where(valid, g, 0.0)
                tl.store(x_row + cols, g.to(X.dtype.element_ty), mask=mask)


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, grad: bool = False, hits: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row float32 losses [T] of logits [T, V] (last dimension contiguous) against int targets
    [T], and with `hits` each row's argmax == target as 1.0/0.0 (else None). With `grad` the logits
    are overwritten by the losses' gradient (for a unit weight per row)."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or logits.dtype not in DTYPES:
        raise ValueError(f"logits must be [T, V] {DTYPES} with contiguous rows, got {tuple(logits.shape)} "
                         f"{logits.dtype} strides {logits.stride()}")
    rows = logits.shape[0]
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    hit = torch.empty(rows if hits else 1, dtype=torch.float32, device=logits.device)
    if rows:
        launch(_ce_rows, (rows,), (logits, targets.contiguous(), losses, hit, logits.shape[1], logits.stride(0)),
               {"IGNORE_INDEX": IGNORE, "GRAD": grad, "HITS": hits, "BLOCK_V": BLOCK,
                "num_warps": 1 if _INTERPRET else 8})
        if hits:  # the kernel's max passes over a NaN; torch.argmax takes it: no hit on a row whose loss is NaN
            hit.masked_fill_(torch.isnan(losses), 0.0)
    return losses, hit if hits else None


def cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor, grad: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The same in torch ops, as the engine computed it: (losses, hits, gradient rounded to the
    logits' dtype or None)."""
    x = logits.detach().float().requires_grad_(grad)
    with torch.enable_grad():
        losses = torch.nn.functional.cross_entropy(x, targets, reduction="none", ignore_index=IGNORE)
        g = torch.autograd.grad(losses.sum(), x)[0].to(logits.dtype) if grad else None
    return losses.detach(), (x.detach().argmax(dim=-1) == targets).float(), g

from kernels.lean_launch import launch  # noqa: E402 (here, not above: a line above a @triton.jit function moves it, and its first line is in its cache key)
