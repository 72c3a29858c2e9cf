"""Training data: the three JSONL formats, loss masks from the chat template, truncation, the
validation split, per-job data order, and packing that is exact (block-causal) and tight."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.engine_ref import padded_batch, synthetic_rows, tiny_model_dir
from trainer.data import (
    IGNORE,
    Example,
    JobDataStream,
    pack_step,
    parse_record,
    read_jsonl,
    split_validation,
    tokenize_all,
    tokenize_record,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir("llama", tmp_path_factory.mktemp("data")))


def trained_text(tok, ex: Example) -> str:  # noqa: ANN001
    return tok.decode([t for t, lab in zip(ex.input_ids, ex.labels, strict=True) if lab != IGNORE])


def test_formats_parse_and_bad_rows_name_their_line(tmp_path) -> None:  # noqa: ANN001
    chat = parse_record({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    pc = parse_record({"prompt": "a", "completion": "b"})
    dpo = parse_record({"prompt": "a", "chosen": "good", "rejected": "bad"})
    assert chat.messages[1] == {"role": "assistant", "content": "yo"}
    assert pc.messages == ({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"})
    assert dpo.messages[1]["content"] == "good" and dpo.rejected == "bad"
    for bad in ({"messages": []}, {"messages": [{"role": "user", "content": "only user"}]},
                {"messages": [{"role": "robot", "content": "x"}]}, {"text": "x"}):
        with pytest.raises(ValueError):
            parse_record(bad)
    p = tmp_path / "f.jsonl"
    p.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n\n" + "{not json}\n")
    with pytest.raises(ValueError, match=":3:"):
        read_jsonl(p)


def test_loss_only_on_assistant_tokens_with_and_without_template(tok) -> None:  # noqa: ANN001
    rec = parse_record({"messages": [
        {"role": "system", "content": "be kind"}, {"role": "user", "content": "one two"},
        {"role": "assistant", "content": "three four"}, {"role": "user", "content": "five"},
        {"role": "assistant", "content": "six seven"}]})
    ex = tokenize_record(tok, rec, 512)
    text = trained_text(tok, ex)
    assert "three four" in text and "six seven" in text
    assert "one two" not in text and "be kind" not in text and "five" not in text
    assert tok.decode(ex.input_ids).startswith("<|system|>")
    template = tok.chat_template
    try:
        tok.chat_template = None
        ex2 = tokenize_record(tok, parse_record({"prompt": "one two", "completion": " three"}), 512)
    finally:
        tok.chat_template = template
    assert trained_text(tok, ex2) == " three<|eos|>"
    assert ex2.input_ids[0] == tok.bos_token_id


def test_truncation_and_fully_truncated_examples(tok) -> None:  # noqa: ANN001
    rec = parse_record({"prompt": "one " * 30, "completion": "two three"})
    full = tokenize_record(tok, rec, 4096)
    assert tokenize_record(tok, rec, 8) is None  # the completion is cut off entirely: dropped
    cut = tokenize_record(tok, rec, len(full.input_ids) - 2)
    assert cut is not None and cut.input_ids == full.input_ids[:-2]
    assert len(tokenize_all(tok, [rec, rec], 8)) == 0


def test_validation_split_is_seeded_disjoint_and_shared() -> None:
    exs = [Example((i, i + 1), (IGNORE, i + 1)) for i in range(50)]
    tr, va = split_validation(exs, 0.1, seed=3)
    assert len(va) == 5 and len(tr) == 45 and not set(tr) & set(va)
    assert split_validation(exs, 0.1, seed=3) == (tr, va)
    assert split_validation(exs, 0.1, seed=4)[1] != va
    with pytest.raises(ValueError):
        split_validation(exs[:1])


def test_job_data_order_is_seeded_per_job_covers_epochs_and_resumes() -> None:
    s = JobDataStream(10, seed=1)
    first = s.next_indices(4) + s.next_indices(4) + s.next_indices(2)
    assert sorted(first) == list(range(10)) and s.epoch == 1
    assert JobDataStream(10, seed=2).next_indices(10) != first
    a = JobDataStream(10, seed=7)
    a.next_indices(3)
    b = JobDataStream(10, seed=7)
    b.load_state_dict(a.state_dict())
    assert [a.next_indices(4) for _ in range(5)] == [b.next_indices(4) for _ in range(5)]


def test_packing_is_exact_and_tight(tok, tmp_path) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama", tmp_path), dtype=torch.float64).eval()
    exs = tokenize_all(tok, [parse_record(r) for r in synthetic_rows(24, seed=1)], 64)
    per_job = [exs[:8], exs[8:10], exs[10:24]]
    packed = pack_step(per_job, tok.pad_token_id)
    unpacked = pack_step(per_job, tok.pad_token_id, pack=False)
    assert packed.padded_fraction < 0.2 < unpacked.padded_fraction
    assert packed.input_ids.shape[0] < unpacked.input_ids.shape[0]
    assert packed.real_tokens == sum(len(e.input_ids) for e in exs)
    # a job's rows never hold another job's tokens
    assert len(packed.row_offsets) == 4 and packed.row_offsets[-1] == packed.input_ids.shape[0]
    with torch.no_grad():
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits
        for j, seqs in enumerate(per_job):
            r0, r1 = packed.row_offsets[j], packed.row_offsets[j + 1]
            t = packed.targets[r0:r1].reshape(-1)
            lp = logits[r0:r1].reshape(-1, logits.shape[-1])
            mine = torch.nn.functional.cross_entropy(lp[t != IGNORE], t[t != IGNORE])
            pb = padded_batch(seqs, tok.pad_token_id)
            ref_logits = model(input_ids=pb["input_ids"], attention_mask=pb["attention_mask"],
                               use_cache=False).logits[:, :-1].reshape(-1, logits.shape[-1])
            ref = torch.nn.functional.cross_entropy(ref_logits, pb["labels"][:, 1:].reshape(-1))
            torch.testing.assert_close(mine, ref, atol=1e-10, rtol=1e-10)
