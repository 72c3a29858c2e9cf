"""ORPO on the multi-LoRA engine (tiny random models, CPU): the loss against an independent float64
implementation of the paper's formula (Hong et al. 2024: NLL of the chosen answer plus lambda times
-log sigmoid of the log odds ratio, log odds of the length-normalised likelihood), batched jobs'
losses and adapter gradients against each job alone in PEFT, every family's tiny model, and an
executor run with batching and early exit."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from contract.families import LLAMA_LINEARS as DEFAULT_TARGETS
from contract.protocol import EarlyExitSettings, EvalSettings
from tests.helpers.engine_ref import padded_batch, tiny_model_dir, write_jsonl
from tests.helpers.executor_cfg import executor_config
from trainer.data import IGNORE, parse_record
from trainer.executor import Executor
from trainer.jobs import TrainJob
from trainer.objectives import objective_for
from trainer.orpo import Orpo, orpo_loss
from trainer.pairs import tokenize_pairs
from trainer.tiny import _WORDS, FAMILIES

# (rank, lambda, pairs per step, lr): different ranks, lambdas and batch sizes
JOBS = [(2, 0.1, 1, 1e-2), (4, 0.5, 2, 5e-3), (8, 2.0, 3, 2e-2)]

pytestmark = pytest.mark.usefixtures("one_thread")


def preference_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))

    return [{"prompt": words(2, 10), "chosen": words(1, 8), "rejected": words(1, 8)} for _ in range(n)]


def paper_orpo(chosen: list[tuple[float, int]], rejected: list[tuple[float, int]], lam: float) -> float:
    """The paper's loss in float64 from (summed log-prob, tokens) of each answer, mean over pairs:
    -log P(y_w|x) + lam * -log sigmoid(log(odds(y_w|x) / odds(y_l|x))), with
    P(y|x) = exp(mean token log-prob) and odds(y|x) = P / (1 - P)."""
    total = 0.0
    for (sw, nw), (sl, nl) in zip(chosen, rejected, strict=True):
        pw, pl = math.exp(sw / nw), math.exp(sl / nl)
        ratio = math.log((pw / (1.0 - pw)) / (pl / (1.0 - pl)))
        total += -math.log(pw) + lam * -math.log(1.0 / (1.0 + math.exp(-ratio)))
    return total / len(chosen)


def test_orpo_loss_is_the_papers_formula() -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 30, (2, 64), generator=g).double()
    # mean log-probs from near certainty (-1e-6) to very unlikely (-12)
    means = -torch.cat([torch.rand(2, 60, generator=g, dtype=torch.float64) * 12,
                        torch.tensor([[1e-6, 1e-3, 2.0, 0.5], [0.5, 1e-6, 1e-3, 9.0]], dtype=torch.float64)], 1)
    sums = means * tokens
    for lam in (0.1, 1.0, 3.5):
        loss, ratio = orpo_loss(sums[0], tokens[0], sums[1], tokens[1], lam)
        for i in range(sums.shape[1]):
            want = paper_orpo([(sums[0, i].item(), tokens[0, i].item())],
                              [(sums[1, i].item(), tokens[1, i].item())], lam)
            assert loss[i].item() == pytest.approx(want, rel=1e-9, abs=1e-12), (lam, i)
        assert torch.equal(ratio > 0, means[0] > means[1])  # higher likelihood, higher odds
    # a certain chosen answer (mean log-prob 0) keeps a finite loss and gradient
    s = torch.tensor([0.0, -3.0], dtype=torch.float64, requires_grad=True)
    loss, _ = orpo_loss(s[:1], torch.ones(1, dtype=torch.float64), s[1:], torch.ones(1, dtype=torch.float64), 0.1)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(s.grad).all()


def _world(family: str, root, n: int = 12, seed: int = 7):  # noqa: ANN001, ANN202
    from transformers import AutoTokenizer

    d = tiny_model_dir(family, root)
    tok = AutoTokenizer.from_pretrained(d)
    pairs = tokenize_pairs(tok, [parse_record(r) for r in preference_rows(n, seed=seed)], 40)
    assert len(pairs) == n
    return d, tok, pairs


@pytest.fixture(scope="module")
def world(tmp_path_factory):  # noqa: ANN201
    return _world("llama", tmp_path_factory.mktemp("orpo"), 24)


def specs(steps: int = 4) -> list[TrainJob]:
    return [TrainJob(f"j{i}", lora_rank=r, lora_alpha=2.0 * r, learning_rate=lr, batch_size=b,
                     knobs={"orpo_lambda": lam}, seed=3 + i, max_steps=steps, max_grad_norm=None)
            for i, (r, lam, b, lr) in enumerate(JOBS)]


def answer_logps(model, seqs, pad_id: int) -> list[tuple[torch.Tensor, int]]:  # noqa: ANN001
    """(summed log-prob, tokens) of each sequence's labelled tokens, one plain forward each (no
    padding: some families' eager attention turns a padded row to NaN)."""
    out = []
    for e in seqs:
        batch = padded_batch([e], pad_id)
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits.double()
        labels = batch["labels"][:, 1:]
        mask = labels != IGNORE
        tok = torch.gather(torch.log_softmax(logits[:, :-1], -1), 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        out.append(((tok * mask).sum(), int(mask.sum())))
    return out


def orpo_alone(world, spec: TrainJob, weights: dict[str, torch.Tensor], pairs) -> tuple[float, dict]:  # noqa: ANN001
    """One job alone in float64 PEFT on padded batches: the paper's loss (autograd through the
    same formula in torch, checked against paper_orpo) and its adapter gradients."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    d, tok, _ = world
    base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64)
    model = get_peft_model(base, LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha, lora_dropout=0.0,
                                            target_modules=list(DEFAULT_TARGETS), task_type="CAUSAL_LM"))
    assert not [k for k in set_peft_model_state_dict(model, weights).unexpected_keys if "lora" in k]
    chosen = answer_logps(model, [p.chosen for p in pairs], tok.pad_token_id)
    rejected = answer_logps(model, [p.rejected for p in pairs], tok.pad_token_id)
    lam = spec.knobs["orpo_lambda"]
    terms = []
    for (sw, nw), (sl, nl) in zip(chosen, rejected, strict=True):
        mw, ml = sw / nw, sl / nl
        odds = (mw - torch.log(1 - torch.exp(mw))) - (ml - torch.log(1 - torch.exp(ml)))
        terms.append(-mw - lam * torch.log(torch.sigmoid(odds)))
    loss = torch.stack(terms).mean()
    plain = paper_orpo([(s.item(), n) for s, n in chosen], [(s.item(), n) for s, n in rejected], lam)
    assert loss.item() == pytest.approx(plain, rel=1e-12)
    loss.backward()
    grads = {name.replace(".default", ""): p.grad.detach().clone()
             for name, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads


def test_batched_orpo_loss_and_gradients_match_each_job_alone(world) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    d, tok, pairs = world
    eng = objective_for("orpo").engine_class(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64),
                                             pairs, tok.pad_token_id, adapter_dtype=torch.float64)
    assert isinstance(eng.objective, Orpo) and not eng.plain_objective
    for s in specs():
        eng.attach(s)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B = 0 at init: start elsewhere so that A gets gradients too
        for s in eng.jobs.values():
            for b in s.adapter.lora_b:
                b.copy_(0.3 * torch.randn(b.shape, generator=g, dtype=torch.float64))
    for _ in range(2):
        before = {j: {k: v.clone() for k, v in s.adapter.peft_state_dict().items()} for j, s in eng.jobs.items()}
        batches = {j: [eng.train_examples[i] for i in copy.deepcopy(s.stream).next_indices(s.batch_size)]
                   for j, s in eng.jobs.items()}
        rep = eng.step()
        for spec in specs():
            j = spec.job_id
            grads = {k: v for k, v in eng.jobs[j].adapter.peft_state_dict(
                flat=eng.slots.grad_arena[slice(*eng.slots.regions[j])]).items()}
            loss, ref_grads = orpo_alone(world, spec, before[j], batches[j])
            assert rep.losses[j] == pytest.approx(loss, rel=1e-10, abs=1e-12)
            assert set(grads) == set(ref_grads) and len(ref_grads) == 2 * 7 * 2
            for k, want in ref_grads.items():
                assert want.abs().max() > 0
                torch.testing.assert_close(grads[k], want, rtol=1e-9, atol=1e-12)
            assert 0.0 <= rep.metrics[j]["reward_accuracy"] <= 1.0 and not rep.skipped[j]
    assert len({round(v, 6) for v in rep.losses.values()}) == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_orpo_trains_on_every_familys_tiny_model(family: str, tmp_path) -> None:  # noqa: ANN001
    """Two jobs in one engine step: the first step's losses are the paper's formula on the
    model's own logits (adapters start at B = 0), and training lowers each job's loss on its
    own pairs."""
    from transformers import AutoModelForCausalLM

    d, tok, pairs = _world(family, tmp_path, n=6, seed=3)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    eng = Orpo().engine_class(model, pairs, tok.pad_token_id)
    for i, lam in enumerate((0.1, 1.0)):
        eng.attach(TrainJob(f"j{i}", lora_rank=4, lora_alpha=8, learning_rate=2e-2, batch_size=6,
                            knobs={"orpo_lambda": lam}, seed=i, max_steps=8, epochs=8))
    with torch.no_grad():
        own = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval()
        if getattr(own.config, "attn_logit_softcapping", None):
            own.set_attn_implementation("eager")  # SDPA has no soft-cap (as the engine does)
        chosen = answer_logps(own, [p.chosen for p in pairs], tok.pad_token_id)
        rejected = answer_logps(own, [p.rejected for p in pairs], tok.pad_token_id)
    first = eng.step()
    for j, lam in (("j0", 0.1), ("j1", 1.0)):
        want = paper_orpo([(s.item(), n) for s, n in chosen], [(s.item(), n) for s, n in rejected], lam)
        assert first.losses[j] == pytest.approx(want, rel=2e-4), family
    for _ in range(7):
        last = eng.step()
    assert all(math.isfinite(v) and v < first.losses[j] for j, v in last.losses.items()), (family, last.losses)


def test_executor_trains_an_orpo_task_with_batching_and_early_exit(tmp_path, world) -> None:  # noqa: ANN001
    d, _, _ = world
    train = write_jsonl(tmp_path / "pref.jsonl", preference_rows(24, seed=11))
    jobs = [TrainJob(f"job{i}", lora_rank=r, lora_alpha=2 * r, learning_rate=lr, batch_size=b, max_steps=8, seed=i,
                     knobs={"orpo_lambda": lam}) for i, (r, lam, b, lr) in enumerate(JOBS + [(4, 0.2, 2, 1e-6)])]
    metrics: list[tuple[str, int, str, dict]] = []
    from trainer.executor import Callbacks

    cfg = executor_config(model_dir=str(d), train_file=str(train), output_dir=str(tmp_path / "run"), jobs=jobs,
                          method="orpo", max_seq_len=40, eval_batch_size=4, checkpoint_every=4,
                          eval=EvalSettings(eval_every_steps=2, eval_max_samples=None),
                          early_exit=EarlyExitSettings(warmup_fraction=0.25, keep_fraction=0.5))
    ex = Executor(cfg, Callbacks(on_metrics=lambda j, s, split, m: metrics.append((j, s, split, m))))
    status = ex.run()
    assert isinstance(ex.objective, Orpo) and ex.engine.objective is ex.objective
    states = {j: v["state"] for j, v in status.items()}
    # the warmup ranking keeps the best half: two jobs train to the end, the others stop early
    assert sorted(states.values()) == ["completed", "completed", "exited", "exited"], status
    val = [m for _, _, split, m in metrics if split == "val"]
    assert val and all(set(m) == {"reward_accuracy", "reward_margin"} for m in val)
