"""DPO on the multi-LoRA engine (tiny random Llama, CPU): batched loss and adapter gradients of
3 jobs against each job alone in a float64 PEFT reference written from the DPO formula, reference
log-probs computed once per sample, NaN isolation, truncation rules, and an executor run."""

from __future__ import annotations

import copy
import math
import random
from collections import defaultdict

import pytest
import torch

from contract.families import LLAMA_LINEARS as DEFAULT_TARGETS
from contract.protocol import EarlyExitSettings, EvalSettings
from tests.helpers.engine_ref import padded_batch, tiny_model_dir, write_jsonl
from tests.helpers.executor_cfg import executor_config
from trainer.data import IGNORE, Record, parse_record
from trainer.dpo import DpoEngine
from trainer.executor import Callbacks, Executor, ExecutorConfig
from trainer.jobs import TrainJob
from trainer.pairs import tokenize_pair, tokenize_pairs, truncate_pair
from trainer.tiny import _WORDS, train_tokenizer

# (rank, beta, pairs per step, lr): different ranks, betas and batch sizes
JOBS = [(2, 0.1, 1, 1e-2), (4, 0.5, 2, 5e-3), (8, 2.0, 3, 2e-2)]


pytestmark = pytest.mark.usefixtures("one_thread")


def preference_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))

    return [{"prompt": words(2, 10), "chosen": words(1, 8), "rejected": words(1, 8)} for _ in range(n)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):  # noqa: ANN201
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("dpo")
    d = tiny_model_dir("llama", root)
    tok = AutoTokenizer.from_pretrained(d)
    pairs = tokenize_pairs(tok, [parse_record(r) for r in preference_rows(24, seed=7)], 40)
    assert len(pairs) == 24
    return d, tok, pairs


def make_engine(world, dtype: torch.dtype = torch.float64) -> DpoEngine:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    d, tok, pairs = world
    model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
    return DpoEngine(model, pairs, tok.pad_token_id, adapter_dtype=dtype)


def specs(steps: int = 4, seeds: tuple[int, ...] = (3, 4, 5)) -> list[TrainJob]:
    return [TrainJob(f"j{i}", lora_rank=r, lora_alpha=2.0 * r, learning_rate=lr, batch_size=b, beta=beta, seed=seeds[i],
                    max_steps=steps, max_grad_norm=None)
            for i, (r, beta, b, lr) in enumerate(JOBS)]


def randomize_b(eng: DpoEngine, seed: int = 0) -> None:
    # B = 0 at init makes policy == reference (loss log 2, no gradient to A): start elsewhere
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for s in eng.jobs.values():
            for b in s.adapter.lora_b:
                b.copy_(0.3 * torch.randn(b.shape, generator=g, dtype=torch.float64))


def response_logps(model, seqs, pad_id: int) -> torch.Tensor:  # noqa: ANN001
    """Summed log-probs of the labelled tokens of each sequence, plain padded forward."""
    batch = padded_batch(seqs, pad_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   use_cache=False).logits.double()
    labels = batch["labels"][:, 1:]
    logp = torch.log_softmax(logits[:, :-1], -1)
    mask = labels != IGNORE
    tok = torch.gather(logp, 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (tok * mask).sum(-1)


def dpo_alone(world, spec: TrainJob, weights: dict[str, torch.Tensor], pairs) -> tuple[float, dict]:  # noqa: ANN001
    """One job alone: its DPO loss from the paper's formula and its adapter gradients (float64,
    PEFT, unpacked padded batches, reference = the same model with the adapter disabled)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    d, tok, _ = world
    base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64)  # as the engine loads it
    model = get_peft_model(base, LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha, lora_dropout=0.0,
                                            target_modules=list(DEFAULT_TARGETS), task_type="CAUSAL_LM"))
    assert not [k for k in set_peft_model_state_dict(model, weights).unexpected_keys if "lora" in k]
    with torch.no_grad(), model.disable_adapter():
        ref_c = response_logps(model, [p.chosen for p in pairs], tok.pad_token_id)
        ref_r = response_logps(model, [p.rejected for p in pairs], tok.pad_token_id)
    pol_c = response_logps(model, [p.chosen for p in pairs], tok.pad_token_id)
    pol_r = response_logps(model, [p.rejected for p in pairs], tok.pad_token_id)
    loss = -torch.nn.functional.logsigmoid(spec.beta * ((pol_c - ref_c) - (pol_r - ref_r))).mean()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            key = name.replace(".default", "")
            grads[key] = p.grad.detach().clone()
    return loss.item(), grads


def step_grads(eng: DpoEngine) -> dict[str, dict[str, torch.Tensor]]:
    """Each job's gradients of the step just taken, from the engine's gradient arena (where the
    update read them; max_grad_norm=None: no clip), under PEFT's names."""
    return {j: {k: v.clone() for k, v in s.adapter.peft_state_dict(
        flat=eng.slots.grad_arena[slice(*eng.slots.regions[j])]).items()} for j, s in eng.jobs.items()}


def test_batched_dpo_loss_and_gradients_match_each_job_alone(world) -> None:  # noqa: ANN001
    eng = make_engine(world)
    for s in specs():
        eng.attach(s)
    randomize_b(eng)
    for _ in range(2):  # the second step runs on updated adapters and partly cached references
        before = {j: {k: v.clone() for k, v in s.adapter.peft_state_dict().items()} for j, s in eng.jobs.items()}
        batches = {j: [eng.train_examples[i] for i in copy.deepcopy(s.stream).next_indices(s.batch_size)]
                   for j, s in eng.jobs.items()}
        rep = eng.step()
        grads = step_grads(eng)
        for spec in specs():
            j = spec.job_id
            loss, ref_grads = dpo_alone(world, spec, before[j], batches[j])
            assert abs(loss - math.log(2)) > 1e-3  # not the trivial policy == reference point
            assert rep.losses[j] == pytest.approx(loss, rel=1e-10, abs=1e-12)
            assert set(grads[j]) == set(ref_grads) and len(ref_grads) == 2 * 7 * 2
            for k, g in ref_grads.items():
                assert g.abs().max() > 0
                torch.testing.assert_close(grads[j][k], g, rtol=1e-9, atol=1e-12)
            assert 0.0 <= rep.metrics[j]["reward_accuracy"] <= 1.0
            assert not rep.skipped[j]
    assert len({round(v, 6) for v in rep.losses.values()}) == 3


def test_reference_log_probs_computed_once_per_sample(world) -> None:  # noqa: ANN001
    eng = make_engine(world, torch.float32)
    # j0 and j1 share a seed (the same pairs each step), j2 overlaps them by chance
    for s in specs(seeds=(1, 1, 2)):
        eng.attach(s)
    seen: set[int] = set()
    for step in range(2):
        for s in eng.jobs.values():
            seen.update(copy.deepcopy(s.stream).next_indices(s.batch_size))
        eng.step()
        assert eng.passes == {"reference": step + 1, "policy": step + 1}
        assert eng.reference_sequences == 2 * len(seen)  # each sample once, whatever job drew it
    assert len(seen) < sum(b for _, _, b, _ in JOBS) * 2  # the two steps did overlap
    val = eng.train_examples[:5]
    m1 = eng.evaluate_metrics(val, batch_size=2)
    passes = dict(eng.passes)
    fresh = {i for i in range(5)} - seen
    assert eng.reference_sequences == 2 * len(seen | fresh)
    m2 = eng.evaluate_metrics(val, batch_size=2, max_sequences=2)  # one job per forward
    assert eng.passes["reference"] == passes["reference"]  # all cached now: no reference pass
    assert eng.passes["policy"] == passes["policy"] + 3 * 3
    for j in m1:
        assert set(m1[j]) == {"loss", "reward_accuracy", "reward_margin"}
        for k in m1[j]:
            assert m1[j][k] == pytest.approx(m2[j][k], rel=1e-5, abs=1e-6)
    # the cache round-trips through its checkpoint form
    other = make_engine(world, torch.float32)
    other.load_reference_state(eng.reference_state())
    assert other.reference == eng.reference and len(other.reference) == len(seen | fresh)


def test_nan_job_leaves_other_jobs_bit_identical(world) -> None:  # noqa: ANN001
    runs = []
    for poison in (False, True):
        eng = make_engine(world, torch.float32)
        for s in specs(3):
            eng.attach(s)
        eng.attach(TrainJob("bad", lora_rank=4, lora_alpha=8, batch_size=2, seed=9, max_steps=3))
        if poison:
            with torch.no_grad():
                eng.jobs["bad"].adapter.lora_a[0].fill_(float("nan"))
        runs.append((eng, [eng.step() for _ in range(3)]))
    (sane, r_sane), (broken, r_broken) = runs
    assert all(r.skipped["bad"] and math.isnan(r.losses["bad"]) for r in r_broken)
    assert not any(r.skipped["bad"] for r in r_sane)
    for j in ("j0", "j1", "j2"):
        assert [r.losses[j] for r in r_sane] == [r.losses[j] for r in r_broken]
        assert [r.metrics[j] for r in r_sane] == [r.metrics[j] for r in r_broken]
        a, b = sane.jobs[j].adapter.state_dict(), broken.jobs[j].adapter.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("chat", [True, False])
def test_truncation_keeps_prompt_end_and_response_starts(chat: bool) -> None:
    tok = train_tokenizer(chat_template=chat)
    prompt = " ".join(_WORDS[:30])
    chosen, rejected = " ".join(_WORDS[30:45]), " ".join(_WORDS[45:52])
    rec = Record(({"role": "user", "content": prompt}, {"role": "assistant", "content": chosen}),
                 rejected=rejected)
    full = tokenize_pair(tok, rec, 10_000)
    n_prompt = full.chosen.labels.index(next(t for t in full.chosen.labels if t != IGNORE))
    prompt_ids = full.chosen.input_ids[:n_prompt]
    resp = {"chosen": full.chosen.input_ids[n_prompt:], "rejected": full.rejected.input_ids[n_prompt:]}
    assert full.rejected.input_ids[:n_prompt] == prompt_ids
    assert len(prompt_ids) > 20 and len(resp["chosen"]) > len(resp["rejected"]) > 4
    longest = len(resp["chosen"])
    # (a) only the prompt gives way (from the left): responses whole
    max_len = n_prompt + longest - 5
    cut = tokenize_pair(tok, rec, max_len, prompt_floor=4)
    for side, ex in (("chosen", cut.chosen), ("rejected", cut.rejected)):
        keep = n_prompt - 5
        assert ex.input_ids == prompt_ids[-keep:] + resp[side]
        assert ex.labels[:keep] == (IGNORE,) * keep and ex.labels[keep:] == resp[side]
    # (b) prompt down to its floor, then the responses from the right
    cut = tokenize_pair(tok, rec, 12, prompt_floor=4)
    for side, ex in (("chosen", cut.chosen), ("rejected", cut.rejected)):
        assert ex.input_ids[:4] == prompt_ids[-4:] and ex.input_ids[4:] == resp[side][:8]
        assert len(ex.input_ids) <= 12
    # default floor: half of max_seq_len
    cut = tokenize_pair(tok, rec, 16)
    assert cut.chosen.input_ids[:8] == prompt_ids[-8:] and cut.chosen.input_ids[8:] == resp["chosen"][:8]
    # a prompt shorter than the floor stays whole
    assert truncate_pair(3, 50, 10, 20, 8) == (3, 17, 10)
    assert truncate_pair(30, 5, 6, 20, 8) == (14, 5, 6)
    assert truncate_pair(30, 40, 6, 20, 8) == (8, 12, 6)
    with pytest.raises(ValueError):
        tokenize_pair(tok, parse_record({"prompt": "a", "completion": "b"}), 32)


def pair_one_call_at_a_time(tok, rec: Record, max_seq_len: int) -> tuple | None:  # noqa: ANN001
    """tokenize_pair's rules with one tokenizer call per text (the reference for the batched one)."""
    prompt = list(rec.messages[:-1])
    sides = []
    for response in (rec.messages[-1]["content"], rec.rejected):
        msgs = [*prompt, {"role": "assistant", "content": response}]
        if tok.chat_template:
            start = len(tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
            text = tok.apply_chat_template(msgs, tokenize=False)
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            n = sum(1 for a, _ in enc["offset_mapping"] if a < start)
            sides.append((enc["input_ids"][:n], enc["input_ids"][n:],
                          [start <= a < len(text) for a, _ in enc["offset_mapping"][n:]]))
        else:
            ids = [tok.bos_token_id] + [t for m in prompt for t in tok(m["content"], add_special_tokens=False)["input_ids"]]
            resp = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            sides.append((ids, resp, [True] * len(resp)))
    keep_p, *keeps = truncate_pair(max(len(sides[0][0]), len(sides[1][0])), len(sides[0][1]), len(sides[1][1]),
                                   max_seq_len, max_seq_len // 2)
    out = []
    for (p, r, t), keep in zip(sides, keeps, strict=True):
        kept = p[len(p) - min(keep_p, len(p)):]
        labels = [IGNORE] * len(kept) + [x if k else IGNORE for x, k in zip(r[:keep], t[:keep], strict=True)]
        if all(lab == IGNORE for lab in labels[1:]):
            return None
        out.append((tuple(kept + r[:keep]), tuple(labels)))
    return tuple(out)


@pytest.mark.parametrize("chat", [True, False])
def test_pairs_tokenised_in_batches_equal_one_call_per_text(chat: bool) -> None:
    """tokenize_pairs encodes many records' texts in one tokenizer call: the same pairs, in order,
    as encoding every text alone, across batch boundaries, a long prompt cut from the left."""
    tok = train_tokenizer(chat_template=chat)
    records = [parse_record(r) for r in preference_rows(11, seed=5)]
    records.insert(4, Record(({"role": "user", "content": " ".join(_WORDS[:40])},
                              {"role": "assistant", "content": "a b"}), rejected="c"))  # its prompt cut
    want = [w for w in (pair_one_call_at_a_time(tok, r, 8 if chat else 12) for r in records) if w is not None]
    assert len(want) == len(records)
    for batch in (2048, 3):
        got = tokenize_pairs(tok, records, 8 if chat else 12, batch=batch)
        assert [((p.chosen.input_ids, p.chosen.labels), (p.rejected.input_ids, p.rejected.labels)) for p in got] == want


class Recorder:
    def __init__(self) -> None:
        self.train: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.evals: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.metrics: list[tuple[str, int, str, dict]] = []
        self.states: dict[str, str] = {}
        self.order: list[str] = []

    def callbacks(self) -> Callbacks:
        return Callbacks(
            on_train_loss=lambda j, s, v: (self.train[j].append((s, v)), self.order.append("train")),
            on_eval=lambda j, s, v: (self.evals[j].append((s, v)), self.order.append("val")),
            on_job_state=lambda j, st, d: self.states.__setitem__(j, st),
            on_metrics=lambda j, s, split, d: (self.metrics.append((j, s, split, d)),
                                               self.order.append("metrics")),
        )


def dpo_config(tmp_path, world, out: str, **kw) -> ExecutorConfig:  # noqa: ANN001
    d, _, _ = world
    train = write_jsonl(tmp_path / "pref.jsonl", preference_rows(20, seed=11))
    jobs = [TrainJob(f"job{i}", lora_rank=r, lora_alpha=2 * r, learning_rate=lr, batch_size=b, beta=beta, max_steps=6, seed=i)
            for i, (r, beta, b, lr) in enumerate(JOBS)]
    base = dict(model_dir=str(d), train_file=str(train), output_dir=str(tmp_path / out), jobs=jobs,
                method="dpo", max_seq_len=40, eval=EvalSettings(eval_every_steps=3, eval_max_samples=None), checkpoint_every=2, eval_batch_size=4,
                early_exit=EarlyExitSettings(enabled=False))
    base.update(kw)
    return executor_config(**base)


def test_executor_runs_a_dpo_task_and_resumes_exactly(tmp_path, world) -> None:  # noqa: ANN001
    rec = Recorder()
    ex = Executor(dpo_config(tmp_path, world, "run"), rec.callbacks())
    status = ex.run()
    assert all(v["state"] == "completed" for v in status.values())
    for j in status:
        assert [s for s, _ in rec.train[j]] == list(range(1, 7))
        assert [s for s, _ in rec.evals[j]] == [3, 6]
        assert all(math.isfinite(v) for _, v in rec.evals[j])
        val = {s: d for jj, s, split, d in rec.metrics if jj == j and split == "val"}
        assert set(val) == {3, 6} and set(val[6]) == {"reward_accuracy", "reward_margin"}
        train = [d for jj, _, split, d in rec.metrics if jj == j and split == "train"]
        assert len(train) == 6
    assert rec.order[0] == "metrics" and rec.order[1] == "train"  # extras come before their point
    # the validation reference is shared: one reference pass per eval chunk, not per job
    n_val = len(ex.val)
    assert ex.engine.reference_sequences <= 2 * (len(ex.engine.train_examples) + n_val)
    # killed after 3 steps and resumed: the cached references come back from the checkpoint
    first, second = Recorder(), Recorder()
    Executor(dpo_config(tmp_path, world, "killed", stop_after_steps=3), first.callbacks()).run()
    resumed = Executor(dpo_config(tmp_path, world, "killed"), second.callbacks())
    assert resumed.run() == status
    assert resumed.engine.reference and resumed.engine.reference_sequences < ex.engine.reference_sequences
    for j, ref in rec.train.items():
        got = first.train.get(j, []) + second.train.get(j, [])
        assert [s for s, _ in got] == [s for s, _ in ref]
        torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in ref]),
                                   atol=1e-6, rtol=1e-6)


def test_memory_probe_step_of_a_dpo_executor_leaves_engine_and_cache_untouched(tmp_path, world) -> None:  # noqa: ANN001
    ex = Executor(dpo_config(tmp_path, world, "probe"))
    ex._load()
    assert isinstance(ex.engine, DpoEngine)
    for spec in ex.cfg.jobs[:2]:
        ex.engine.attach(spec)
    ex.engine.step()
    before = {j: {k: v.clone() for k, v in s.adapter.state_dict().items()} for j, s in ex.engine.jobs.items()}
    cache = dict(ex.engine.reference)
    passes = dict(ex.engine.passes)
    ex.memory.probe_step(3)
    assert ex.engine.passes == {"reference": passes["reference"] + 1, "policy": passes["policy"] + 1}
    assert ex.engine.reference == cache  # the probe's random pairs were forgotten
    assert list(ex.engine.jobs) == list(before)
    for j, w in before.items():
        assert all(torch.equal(v, ex.engine.jobs[j].adapter.state_dict()[k]) for k, v in w.items())
