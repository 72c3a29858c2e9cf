"""Steps of the real engine on a tiny model, for the kernels' interpreter tests (tests/slow): the engine's losses and
weights on one operator form or another."""

from __future__ import annotations

import torch


def tiny_engine_steps(backend: str, form: str, steps: int = 2) -> tuple[list[list[float]], list[torch.Tensor]]:
    """`steps` steps of the real engine (trainer.engine) on a one-layer float32 Llama with three jobs of mixed ranks
    (one not a power of two), the operator form pinned to `form`: each step's losses and the jobs' weights after."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kernels import set_default_form
    from trainer.data import Example
    from trainer.engine import MultiLoraEngine
    from trainer.jobs import TrainJob

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).float()
    data = torch.randint(1, 64, (6, 12), generator=torch.Generator().manual_seed(1))
    eng = MultiLoraEngine(model, [Example(tuple(r.tolist()), tuple(r.tolist())) for r in data], pad_id=0,
                          backend=backend)
    for i, r in enumerate([8, 16, 24]):
        eng.attach(TrainJob(f"j{i}", lora_rank=r, lora_alpha=2 * r, learning_rate=1e-2, batch_size=1, max_steps=100,
                            seed=i))
    set_default_form(form)
    losses = []
    for _ in range(steps):  # a later step's losses see the earlier steps' gradients and updates
        rep = eng.step()
        losses.append([rep.losses[f"j{i}"] for i in range(3)])
    return losses, [eng.jobs[f"j{i}"].adapter.flat.detach().clone() for i in range(3)]
