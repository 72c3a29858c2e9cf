"""Samples on CUDA at the Llama-3.1-8B shape (issue 44): the static-cache decode with graphed token
steps (trainer.decode_graph, the default on CUDA) gives each adapter's own PEFT `generate` and the
base model's own greedy completions token for token (float32, two layers of the real widths, the
real vocabulary), repeats itself exactly in bfloat16, and seeded sampling repeats; a token step's
attention in bfloat16 is near float64 and repeats. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from trainer.engine import MultiLoraEngine  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402
from trainer.sampling import generate  # noqa: E402

NEW = 24
RANKS = {"a": 16, "b": 64}


def shaped_model(dtype: torch.dtype, layers: int = 2):  # noqa: ANN201
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, num_hidden_layers=layers, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                      bos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def with_adapters(model) -> MultiLoraEngine:  # noqa: ANN001
    engine = MultiLoraEngine(model, [], 0, gradient_checkpointing=False)
    for i, (job_id, rank) in enumerate(RANKS.items()):
        state = engine.attach(TrainJob(job_id, lora_rank=rank, lora_alpha=2.0 * rank, seed=i, max_steps=1))
        g = torch.Generator(device="cuda").manual_seed(10 + i)
        with torch.no_grad():
            for b in state.adapter.lora_b:
                b.copy_(torch.randn(b.shape, generator=g, device="cuda") * 0.02)
    return engine


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 128000, (int(L),), generator=g).tolist() for L in torch.randint(5, 40, (n,), generator=g)]


def test_graphed_greedy_equals_peft_generate_at_the_8b_shape() -> None:
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    base = shaped_model(torch.float32)
    reference = copy.deepcopy(base)  # the plain model, before the engine wraps its linears
    engine = with_adapters(base)
    ps = prompts(4)
    rows = [(p, j) for p in ps for j in (None, *RANKS)]
    got = generate(engine, [p for p, _ in rows], [j for _, j in rows], max_new_tokens=NEW, pad_id=0)
    assert [len(c) for c in got] == [NEW] * len(rows)  # no EOS on this model's random weights
    peft = {}
    for job_id in RANKS:
        adapter = engine.jobs[job_id].adapter
        cfg = LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, target_modules=list(engine.targets),
                         lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
        model = get_peft_model(copy.deepcopy(reference), cfg)
        set_peft_model_state_dict(model, adapter.peft_state_dict())
        peft[job_id] = model.eval()
    for (p, job_id), tokens in zip(rows, got, strict=True):
        model = reference if job_id is None else peft[job_id]
        ids = torch.tensor([p], device="cuda")
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        assert tokens == out[0, len(p):].tolist(), job_id


def bf16_rows(seed: int) -> tuple[MultiLoraEngine, list[list[int]], list[str | None]]:
    """The bfloat16 model with both adapters, and 8 prompts each decoded by the base and each adapter."""
    engine = with_adapters(shaped_model(torch.bfloat16))
    rows = [(p, j) for p in prompts(8, seed=seed) for j in (None, *RANKS)]
    return engine, [p for p, _ in rows], [j for _, j in rows]


def test_graphed_greedy_repeats_in_bf16_and_seeded_sampling_repeats() -> None:
    engine, texts, jobs = bf16_rows(1)
    first = generate(engine, texts, jobs, max_new_tokens=NEW, pad_id=0)
    assert generate(engine, texts, jobs, max_new_tokens=NEW, pad_id=0) == first
    sampled = generate(engine, texts, jobs, max_new_tokens=NEW, pad_id=0, temperature=1.0, top_p=0.9, seed=7)
    assert generate(engine, texts, jobs, max_new_tokens=NEW, pad_id=0, temperature=1.0, top_p=0.9, seed=7) == sampled
    assert sampled != first


def test_a_node_decode_repeats_in_bf16_with_padded_rows_and_a_growing_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    # as a node runs it (trainer.sampling.repeatable: the token steps' own attention, math SDPA for the
    # prefill, deterministic algorithms only off the static path): at 32
    # layers, 32 rows of 200 tokens, the memory-efficient attention's token steps did not repeat (session
    # 23's probe on an H200); here 4 layers, rows of unequal length (padded), eager and graphed
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.delenv("LORAPLEX_DECODE_SDPA", raising=False)
    monkeypatch.delenv("LORAPLEX_REPEATABLE_DECODE", raising=False)
    engine = with_adapters(shaped_model(torch.bfloat16, layers=4))
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(10, 128000, (int(n),), generator=g).tolist() for n in torch.randint(150, 230, (8,), generator=g)]
    rows = [(p, j) for p in ps for j in (None, *RANKS, "a")]
    texts, jobs = [p for p, _ in rows], [j for _, j in rows]
    for static in (False, True):
        first = generate(engine, texts, jobs, max_new_tokens=16, pad_id=0, static=static)
        for _ in range(2):
            assert generate(engine, texts, jobs, max_new_tokens=16, pad_id=0, static=static) == first, static


def test_the_decode_capture_leaves_another_threads_event_wait_alone() -> None:
    # the end of a task decodes its samples while the task's writer thread waits on a snapshot's
    # event (trainer.checkpoint.Snapshot.wait); under the default capture mode (global) that wait
    # failed while the token step was being captured, and the task with it (H100, session 30)
    import threading

    from trainer import decode_graph

    engine, texts, jobs = bf16_rows(2)
    alone = generate(engine, texts, jobs, max_new_tokens=NEW, pad_id=0)
    event = torch.cuda.Event()
    event.record()
    errors: list[BaseException] = []
    waits = [0]
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            try:
                event.synchronize()
                waits[0] += 1
            except BaseException as exc:  # noqa: BLE001 - what the test reports
                errors.append(exc)
                return

    captured = []
    real = decode_graph.StaticDecoder._capture

    def capture(self) -> None:  # noqa: ANN001
        real(self)
        captured.append(self.graph is not None)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        decode_graph.StaticDecoder._capture = capture
        during = generate(engine, texts, jobs, max_new_tokens=NEW, pad_id=0)
    finally:
        decode_graph.StaticDecoder._capture = real
        stop.set()
        thread.join()
    assert errors == [] and captured and all(captured) and waits[0] > 0
    assert during == alone


def test_the_token_steps_attention_in_bf16_is_near_float64_and_repeats() -> None:
    # trainer.decode_attention: cuBLAS's float32 scores from the bfloat16 cache (no float32 copy of it),
    # at a token step's shape of the 8B model (32 rows, 8 key/value heads of 4 queries, a 328-long cache)
    import types

    from trainer.decode_attention import decode_sdpa_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    rows, length = 32, 328
    q = torch.randn(rows, 32, 1, 128, generator=g, device="cuda")
    k, v = (torch.randn(rows, 8, length, 128, generator=g, device="cuda") for _ in range(2))
    mask = torch.ones(rows, 1, 1, length, dtype=torch.bool, device="cuda")
    for r in range(rows):
        mask[r, ..., : 5 * r] = False  # left padding
    module = types.SimpleNamespace(num_key_value_groups=4, is_causal=True)
    want = decode_sdpa_attention(module, q.double(), k.double(), v.double(), mask, scaling=128 ** -0.5)[0]
    got = decode_sdpa_attention(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, scaling=128 ** -0.5)[0]
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max().item() < 2 ** -7 * want.abs().max().item()
    again = decode_sdpa_attention(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, scaling=128 ** -0.5)[0]
    assert torch.equal(got, again)
