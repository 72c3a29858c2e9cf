"""Which rounding transformers' own rotary function has on this machine, against kernels.rope and
the bfloat16 ops (a probe for tests/gpu/test_norm_act_gpu.py's bit claim)."""
import importlib.util
import inspect

import torch
from transformers.models.llama import modeling_llama as ml

from kernels.rope import rope, rope_reference

own = getattr(ml.apply_rotary_pos_emb, "loraplex_own", ml.apply_rotary_pos_emb)
print("kernels package:", importlib.util.find_spec("kernels") is not None)
print(inspect.getsource(own)[-600:])
torch.manual_seed(2)
q, k = (torch.randn(1, 64, h * 128, device="cuda", dtype=torch.bfloat16).view(1, 64, h, 128).transpose(1, 2) for h in (32, 8))
cos, sin = (torch.randn(1, 64, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
a, b, c = rope(q, k, cos, sin)[0], own(q, k, cos, sin)[0], rope_reference(q, k, cos, sin)[0]
f = rope_reference(q.float(), k.float(), cos.float(), sin.float())[0].to(torch.bfloat16)
for name, x in (("kernel", a), ("own", b), ("bf16 ops", c), ("fp32 once", f)):
    print(name, "== own:", torch.equal(x, b), "== bf16 ops:", torch.equal(x, c), "== fp32 once:", torch.equal(x, f),
          "max diff to own", (x.float() - b.float()).abs().max().item())
