"""``python -m tests.helpers.cuda_child --dir DIR``: a node's GPU process at work: a matmul and the
engine's grouped LoRA operator (Triton) forward and backward on its GPU, written to DIR/cuda.json
with what it sees (its devices, whether torch was imported before its first line)."""

import json
import sys
from pathlib import Path

if __name__ == "__main__":
    imported_before = "torch" in sys.modules and "trainer.executor" in sys.modules
    import torch

    from kernels import multilora_linear_arena
    from kernels.testing import make_case

    x = torch.randn(256, 256, device="cuda", dtype=torch.float64)
    err = ((x @ x).cpu() - x.cpu() @ x.cpu()).abs().max().item()
    c = make_case([300, 0, 212], [16, 64, 24], 512, 768, dtype=torch.bfloat16, device="cuda")
    xs = c.x.detach().clone().requires_grad_()
    arena = torch.randn(200000, device="cuda", dtype=torch.bfloat16)
    grad = torch.zeros(200000, device="cuda", dtype=torch.float32)
    a_off = torch.tensor([0, 16 * 512, 96 * 512], device="cuda")
    token = torch.zeros((), device="cuda", requires_grad=True)
    y = multilora_linear_arena(xs, c.weight, None, arena, grad, a_off, a_off + 120 * 512, c.scales, c.ranks,
                               c.offsets, 64, token)
    y.float().sum().backward()
    torch.cuda.synchronize()
    Path(sys.argv[2], "cuda.json").write_text(json.dumps({
        "imported_before": imported_before, "devices": torch.cuda.device_count(), "matmul_err": err,
        "lora_finite": bool(torch.isfinite(y).all().item() and torch.isfinite(xs.grad).all().item()),
        "grad_nonzero": bool(grad.abs().sum().item() > 0)}))
