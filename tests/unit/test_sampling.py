"""trainer.sampling on CPU: one decode loop for many adapters at once. Greedy completions equal
PEFT's `generate` with the same adapter (and the plain model's for base rows), for every family's
tiny model, prompts of different lengths and two ranks in one batch; seeded sampling repeats;
EOS and max_new_tokens stop rows independently; the engine is left exactly as found."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir
from trainer.data import parse_record, tokenize_all
from trainer.decode_graph import static_decodable
from trainer.engine import MultiLoraEngine
from trainer.jobs import TrainJob
from trainer.sampling import generate, nucleus_pick
from trainer.tiny import FAMILIES

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 8
RANKS = {"a": 2, "b": 4}
# float64 keeps every argmax far from a tie on these random models, except where transformers'
# own eager attention (Gemma-2's and VaultGemma's attention soft-cap) cannot run float64 with
# padding: it adds float64's most negative number as the mask and takes the softmax in float32,
# where that is -inf, so a left pad (a query with no key) turns NaN, in its own generate too
FLOAT32 = {"gemma2", "vaultgemma"}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sampling")


def load(model_dir: Path, dtype: torch.dtype):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if getattr(model.config, "attn_logit_softcapping", None):
        model.set_attn_implementation("eager")  # the soft-cap: the engine's attention too
    return model.eval()


def engine_with_adapters(model_dir: Path, dtype: torch.dtype, examples=(), **kw) -> MultiLoraEngine:  # noqa: ANN001, ANN003
    """An engine with jobs "a" and "b" (ranks 2 and 4) whose B weights are random, so that each
    adapter changes the completions."""
    model = load(model_dir, dtype)
    engine = MultiLoraEngine(model, list(examples), model.config.pad_token_id, **kw)
    for i, (job_id, rank) in enumerate(RANKS.items()):
        state = engine.attach(TrainJob(job_id, lora_rank=rank, lora_alpha=2.0 * rank, seed=i,
                                       learning_rate=1e-2, batch_size=2, max_steps=10))
        g = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for b in state.adapter.lora_b:
                b.copy_(torch.randn(b.shape, generator=g))
    return engine


def peft_of(model_dir: Path, dtype: torch.dtype, engine: MultiLoraEngine, job_id: str):  # noqa: ANN201
    """The plain model with the job's adapter loaded by PEFT."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    adapter = engine.jobs[job_id].adapter
    cfg = LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, target_modules=list(engine.targets),
                     lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(load(model_dir, dtype), cfg)
    set_peft_model_state_dict(model, adapter.peft_state_dict())
    return model.eval()


def hf_greedy(model, prompt: list[int], eos: int) -> list[int]:  # noqa: ANN001
    """transformers' own greedy generate of one unpadded prompt: its new tokens."""
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                         do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt):].tolist()


def random_prompts(vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]  # past the specials


def mixed_rows(prompts: list[list[int]]) -> tuple[list[list[int]], list[str | None]]:
    """Every prompt under the base model and under each job, the rows shuffled (not grouped)."""
    rows = [(p, j) for p in prompts for j in (None, *RANKS)]
    random.Random(1).shuffle(rows)
    return [p for p, _ in rows], [j for _, j in rows]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_each_adapters_own_generate(family: str, root: Path) -> None:
    dtype = torch.float32 if family in FLOAT32 else torch.float64
    model_dir = tiny_model_dir(family, root)
    engine = engine_with_adapters(model_dir, dtype)
    config = engine.model.config
    prompts, job_ids = mixed_rows(random_prompts(config.vocab_size, (3, 9, 14, 6)))
    got = generate(engine, prompts, job_ids, max_new_tokens=NEW, eos_token_id=config.eos_token_id,
                   pad_id=config.pad_token_id)
    references = {None: load(model_dir, dtype)}
    references.update({j: peft_of(model_dir, dtype, engine, j) for j in RANKS})
    want = [hf_greedy(references[j], p, config.eos_token_id) for p, j in zip(prompts, job_ids, strict=True)]
    assert got == want
    # each adapter changes some completion, so the comparison above sees its LoRA path; on the
    # tiny Gemma-2 (its sublayers' outputs normed, its embedding scaled up) the residual mostly
    # repeats the last token whatever the adapter: there one adapter does
    by_row = {(tuple(p), j): g for p, j, g in zip(prompts, job_ids, got, strict=True)}
    changed = [j for j in RANKS if any(by_row[(tuple(p), j)] != by_row[(tuple(p), None)] for p in prompts)]
    assert len(changed) >= (1 if family == "gemma2" else len(RANKS)), changed


def test_groups_of_unequal_rows_equal_each_adapters_own_generate(root: Path) -> None:
    # rows per job differ (the layers' per-group matmuls, not the stacked ones): a prefill's row
    # holds many tokens, each group's term lands on its own batch rows
    model_dir = tiny_model_dir("llama", root)
    engine = engine_with_adapters(model_dir, torch.float64)
    config = engine.model.config
    prompts = random_prompts(config.vocab_size, (3, 9, 14, 6, 5), seed=4)
    job_ids = ["a", None, "b", "a", "a"]
    got = generate(engine, prompts, job_ids, max_new_tokens=NEW, eos_token_id=config.eos_token_id,
                   pad_id=config.pad_token_id)
    references = {None: load(model_dir, torch.float64)}
    references.update({j: peft_of(model_dir, torch.float64, engine, j) for j in set(job_ids) - {None}})
    assert got == [hf_greedy(references[j], p, config.eos_token_id) for p, j in zip(prompts, job_ids, strict=True)]


@pytest.fixture(scope="module")
def llama(root: Path) -> MultiLoraEngine:
    return engine_with_adapters(tiny_model_dir("llama", root), torch.float32)


def test_seeded_sampling_repeats_and_another_seed_differs(llama: MultiLoraEngine) -> None:
    prompts, job_ids = mixed_rows(random_prompts(llama.model.config.vocab_size, (2, 6, 11)))
    pad = llama.pad_id

    def sample(seed: int, temperature: float = 1.0, top_p: float = 0.9) -> list[list[int]]:
        return generate(llama, prompts, job_ids, max_new_tokens=NEW, temperature=temperature,
                        top_p=top_p, seed=seed, pad_id=pad)

    first = sample(3)
    assert sample(3) == first
    assert sample(4) != first
    greedy = generate(llama, prompts, job_ids, max_new_tokens=NEW, pad_id=pad)
    assert first != greedy
    # a nucleus of one token is the argmax, whatever the temperature and the seed
    assert sample(5, temperature=2.0, top_p=1e-9) == greedy


def test_nucleus_keeps_the_likeliest_tokens_up_to_top_p() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    assert set(nucleus_pick(logits, 1.0, 0.7, g).tolist()) == {0, 1}
    assert set(nucleus_pick(logits, 1.0, 0.8, g).tolist()) == {0, 1}
    assert set(nucleus_pick(logits, 1.0, 0.81, g).tolist()) == {0, 1, 2}
    assert set(nucleus_pick(logits, 1.0, 0.5, g).tolist()) == {0}
    assert set(nucleus_pick(logits, 1.0, 1.0, g).tolist()) == {0, 1, 2, 3}
    assert nucleus_pick(logits[:1], 0.0, 0.1, None).tolist() == [0]


def test_eos_and_max_new_tokens_stop_rows_independently(llama: MultiLoraEngine) -> None:
    prompts = random_prompts(llama.model.config.vocab_size, (4, 8, 5, 12), seed=2)
    job_ids = ["a", None, "b", "a"]
    pad = llama.pad_id
    full = generate(llama, prompts, job_ids, max_new_tokens=NEW, pad_id=pad)
    assert [len(c) for c in full] == [NEW] * 4
    short = generate(llama, prompts, job_ids, max_new_tokens=3, pad_id=pad)
    assert short == [c[:3] for c in full]
    # EOS: a token of row 0's completion that some other row never produces
    eos = next(t for t in full[0][1:] if any(t not in c for c in full[1:]))
    stop = full[0].index(eos) + 1
    for eos_arg in (eos, [eos, -1]):
        got = generate(llama, prompts, job_ids, max_new_tokens=NEW, eos_token_id=eos_arg, pad_id=pad)
        # a row ends with its first EOS (kept); a row without one runs to max_new_tokens
        want = [c[: c.index(eos) + 1] if eos in c else c for c in full]
        assert got == want
        assert len(got[0]) == stop < NEW
        assert any(len(c) == NEW for c in got)
    # the base model alone (no job in the batch) and one row
    assert generate(llama, prompts[1:2], [None], max_new_tokens=NEW, pad_id=pad) == full[1:2]
    assert generate(llama, prompts, job_ids, max_new_tokens=0, pad_id=pad) == [[]] * 4


def engine_state(engine: MultiLoraEngine) -> dict:
    model = engine.model
    return {
        "attention": engine.attention,
        "implementation": model.config._attn_implementation,
        "training": [m.training for m in model.modules()],
        "checkpointing": [engine.gradient_checkpointing,
                          *(getattr(m, "gradient_checkpointing", None) for m in model.modules())],
        "step_graphs": engine.step_graphs,
        "layouts": [(layer.layout, layer.a_off, layer.b_off) for layer in engine.layer_list],
        "arena": engine.slots.arena.clone(),
        "grad_arena": engine.slots.grad_arena.clone(),
    }


def assert_same_state(before: dict, after: dict) -> None:
    for key in ("arena", "grad_arena"):
        torch.testing.assert_close(after.pop(key), before.pop(key), rtol=0, atol=0)
    assert after == before


def test_engine_is_left_as_found_training_in_varlen(root: Path) -> None:
    """An engine mid-training (varlen attention, train mode, gradient checkpointing): the same
    state after generate, even when a forward raises, and its next step is the step of a twin
    engine that never sampled."""
    from transformers import AutoTokenizer

    model_dir = tiny_model_dir("llama", root)
    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = tokenize_all(tok, [parse_record(r) for r in synthetic_rows(8, seed=3)], 48)
    engines = [engine_with_adapters(model_dir, torch.float32, examples, attention="varlen",
                                    gradient_checkpointing=True) for _ in range(2)]
    for engine in engines:
        engine.step()
    engine, twin = engines
    before = engine_state(engine)
    assert before["attention"] == "varlen" and engine.model.training and engine.gradient_checkpointing
    prompts = random_prompts(engine.model.config.vocab_size, (3, 7, 5))
    out = generate(engine, prompts, ["b", None, "a"], max_new_tokens=4, temperature=0.8, seed=1,
                   pad_id=engine.pad_id)
    assert [len(c) for c in out] == [4, 4, 4]
    assert_same_state(before, engine_state(engine))

    def broken(_h: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("head failed")

    before = engine_state(engine)
    head, engine.output_logits = engine.output_logits, broken  # fails after the prefill: layouts set, attention switched
    try:
        with pytest.raises(RuntimeError, match="head failed"):
            generate(engine, prompts, ["a", "a", None], max_new_tokens=4, pad_id=engine.pad_id)
    finally:
        engine.output_logits = head
    assert_same_state(before, engine_state(engine))
    assert all(lay == (None, None, None) for lay in before["layouts"])
    assert engine.step().losses == twin.step().losses


def test_bad_calls_are_refused(llama: MultiLoraEngine) -> None:
    pad = llama.pad_id
    with pytest.raises(ValueError, match="job ids"):
        generate(llama, [[11, 12]], [None, "a"], max_new_tokens=2, pad_id=pad)
    with pytest.raises(ValueError, match="not attached"):
        generate(llama, [[11, 12]], ["zzz"], max_new_tokens=2, pad_id=pad)
    with pytest.raises(ValueError, match="at least one token"):
        generate(llama, [[]], [None], max_new_tokens=2, pad_id=pad)
    with pytest.raises(ValueError, match="top_p"):
        generate(llama, [[11]], [None], max_new_tokens=2, temperature=1.0, top_p=0.0, pad_id=pad)


@pytest.mark.parametrize("family", FAMILIES)
def test_static_cache_decode_equals_each_adapters_own_generate(family: str, root: Path) -> None:
    """The static path (trainer.decode_graph: preallocated KV cache, a fixed boolean mask, the
    token step that CUDA replays as a graph; run eagerly here) gives PEFT's and transformers' own
    greedy completions where it is used; the families it is not used for are the ones whose
    attention it cannot mask (sliding windows, another attention than SDPA)."""
    dtype = torch.float32 if family in FLOAT32 else torch.float64
    model_dir = tiny_model_dir(family, root)
    engine = engine_with_adapters(model_dir, dtype)
    config = engine.model.config
    if not static_decodable(engine.model, 0.0):
        assert config._attn_implementation != "sdpa" or getattr(config, "sliding_window", None) or any(
            t != "full_attention" for t in getattr(config, "layer_types", None) or [])
        return
    prompts, job_ids = mixed_rows(random_prompts(config.vocab_size, (3, 9, 14, 6)))
    got = generate(engine, prompts, job_ids, max_new_tokens=NEW, eos_token_id=config.eos_token_id,
                   pad_id=config.pad_token_id, static=True)
    assert got == generate(engine, prompts, job_ids, max_new_tokens=NEW, eos_token_id=config.eos_token_id,
                           pad_id=config.pad_token_id, static=False)
    references = {None: load(model_dir, dtype)}
    references.update({j: peft_of(model_dir, dtype, engine, j) for j in RANKS})
    want = [hf_greedy(references[j], p, config.eos_token_id) for p, j in zip(prompts, job_ids, strict=True)]
    assert got == want


def test_static_decode_stops_rows_at_eos_like_the_eager_loop(llama: MultiLoraEngine) -> None:
    prompts = random_prompts(llama.model.config.vocab_size, (4, 8, 5, 12), seed=2)
    job_ids = ["a", None, "b", "a"]
    pad = llama.pad_id
    new = 40  # past the static path's EOS checks (every 16 steps)
    full = generate(llama, prompts, job_ids, max_new_tokens=new, pad_id=pad, static=False)
    assert generate(llama, prompts, job_ids, max_new_tokens=new, pad_id=pad, static=True) == full
    eos = next(t for t in full[0][1:] if any(t not in c for c in full[1:]))
    want = [c[: c.index(eos) + 1] if eos in c else c for c in full]
    assert generate(llama, prompts, job_ids, max_new_tokens=new, eos_token_id=eos, pad_id=pad, static=True) == want
    everyone = [c[0] for c in full]  # each row's first token ends it: the loop stops at its first check
    parts: dict[str, float] = {}
    assert generate(llama, prompts, job_ids, max_new_tokens=new, eos_token_id=everyone, pad_id=pad,
                    static=True, parts=parts) == [c[: c.index(next(t for t in c if t in everyone)) + 1] for c in full]
    # the decode's split: the static path's prefill and token steps (no graphs on the CPU: every step
    # eager), stopped at the first EOS check (16 steps in)
    assert {"point", "prefill", "steps", "eager_steps"} <= set(parts) and "capture" not in parts
    assert parts["token_steps"] == 16 and parts["eager_steps"] <= parts["steps"]
