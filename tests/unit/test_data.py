"""Training data: the JSONL formats (chat with weights / text parts / tools, prompt/completion,
text, both preference shapes) and what each trains on, loss masks from the chat template, truncation, the
validation split, per-job data order, and packing that is exact (block-causal) and tight."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from tests.helpers.engine_ref import padded_batch, synthetic_rows, tiny_model_dir
from trainer.data import (
    IGNORE,
    Example,
    JobDataStream,
    parse_record,
    read_jsonl,
    split_validation,
    tokenize_all,
    tokenize_record,
)
from trainer.packing import pack_step
from trainer.pairs import tokenize_pair


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
                {"messages": [{"role": "robot", "content": "x"}]}, {"body": "x"}, {"text": " "}):
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


def _no_template(tok):  # noqa: ANN001, ANN202
    class _Plain:
        def __enter__(self):  # noqa: ANN204
            self.saved, tok.chat_template = tok.chat_template, None

        def __exit__(self, *exc):  # noqa: ANN002, ANN204
            tok.chat_template = self.saved

    return _Plain()


def test_weight_zero_assistant_message_is_context_not_trained(tok) -> None:  # noqa: ANN001
    msgs = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two three",
                                                   "weight": 0},
            {"role": "user", "content": "four"}, {"role": "assistant", "content": "five six",
                                                   "weight": 1}]
    rec = parse_record({"messages": msgs})
    assert rec.weights == (0, 0, 0, 1)
    unweighted = parse_record({"messages": [{k: v for k, v in m.items() if k != "weight"}
                                            for m in msgs]})
    assert unweighted.weights is None
    for template in (True, False):
        if template:
            ex, full = tokenize_record(tok, rec, 512), tokenize_record(tok, unweighted, 512)
        else:
            with _no_template(tok):
                ex, full = tokenize_record(tok, rec, 512), tokenize_record(tok, unweighted, 512)
        assert ex.input_ids == full.input_ids  # the weight-0 answer stays in the context
        assert "five six" in trained_text(tok, ex) and "two three" not in trained_text(tok, ex)
        assert "two three" in trained_text(tok, full)
        # exactly the weighted message's tokens lost their labels
        dropped = [i for i, (a, b) in enumerate(zip(ex.labels, full.labels, strict=True)) if a != b]
        assert dropped and all(ex.labels[i] == IGNORE for i in dropped)
        assert "two three" in tok.decode([full.input_ids[i] for i in dropped])
    with pytest.raises(ValueError, match="weight 1"):
        parse_record({"messages": [msgs[0], msgs[1]]})  # nothing left to train
    for bad in (2, 0.5, True, "1"):
        with pytest.raises(ValueError, match="weight"):
            parse_record({"messages": [msgs[0], {**msgs[3], "weight": bad}]})
    with pytest.raises(ValueError, match="weight"):
        parse_record({"messages": [{**msgs[0], "weight": 1}, msgs[3]]})


def test_content_as_text_parts_equals_the_string(tok) -> None:  # noqa: ANN001
    plain = parse_record({"messages": [{"role": "user", "content": "one two"},
                                       {"role": "assistant", "content": "three four"}]})
    parts = parse_record({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "one "}, {"type": "text",
                                                                        "text": "two"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "three four"}]}]})
    assert parts == plain
    assert tokenize_record(tok, parts, 512) == tokenize_record(tok, plain, 512)
    with pytest.raises(ValueError, match="text parts"):
        parse_record({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                  "image_url": {"url": "x"}}]},
                                   {"role": "assistant", "content": "a"}]})


def test_tools_are_ignored(tok) -> None:  # noqa: ANN001
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    rec = parse_record({"tools": [{"type": "function", "function": {"name": "f"}}], "messages": [
        {"role": "user", "content": "one"}, {"role": "assistant", "content": None,
                                             "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "two"}]})
    assert rec.messages == ({"role": "user", "content": "one"},
                            {"role": "assistant", "content": "two"})
    assert "42" not in tok.decode(tokenize_record(tok, rec, 512).input_ids)


def test_text_records_train_on_every_token(tok) -> None:  # noqa: ANN001
    rec = parse_record({"text": "one two three"})
    assert rec.text == "one two three" and rec.messages == ()
    ex = tokenize_record(tok, rec, 512)
    assert ex.input_ids[0] == tok.bos_token_id and ex.labels[0] == IGNORE
    assert ex.labels[1:] == ex.input_ids[1:] and ex.input_ids[-1] == tok.eos_token_id
    assert tok.decode(ex.input_ids[1:-1]).strip() == "one two three"
    assert "<|user|>" not in tok.decode(ex.input_ids)  # no chat template around plain text
    cut = tokenize_record(tok, rec, 3)
    assert cut.input_ids == ex.input_ids[:3]


def test_preference_shapes_agree(tok) -> None:  # noqa: ANN001
    classic = parse_record({"prompt": "one two", "chosen": "three", "rejected": "four"})
    openai = parse_record({"input": {"messages": [{"role": "user", "content": "one two"}]},
                           "preferred_output": [{"role": "assistant", "content": "three"}],
                           "non_preferred_output": [{"role": "assistant", "content": [
                               {"type": "text", "text": "four"}]}]})
    assert openai == classic
    pair = tokenize_pair(tok, openai, 64)
    assert pair == tokenize_pair(tok, classic, 64)
    assert "three" in trained_text(tok, pair.chosen) and "four" in trained_text(tok, pair.rejected)
    assert "one two" not in trained_text(tok, pair.chosen)
    multi = parse_record({"input": {"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}]},
        "preferred_output": [{"role": "assistant", "content": "four"}],
        "non_preferred_output": [{"role": "assistant", "content": "five"}]})
    assert [m["role"] for m in multi.messages] == ["system", "user", "assistant", "user",
                                                   "assistant"]
    mp = tokenize_pair(tok, multi, 128)
    assert trained_text(tok, mp.chosen).startswith("four")  # earlier turns are prompt only
    for bad in ({"input": {"messages": []}, "preferred_output": [], "non_preferred_output": []},
                {"input": {"messages": [{"role": "user", "content": "a"}]},
                 "preferred_output": [{"role": "user", "content": "b"}],
                 "non_preferred_output": [{"role": "assistant", "content": "c"}]},
                {"input": "a", "preferred_output": [{"role": "assistant", "content": "b"}],
                 "non_preferred_output": [{"role": "assistant", "content": "c"}]}):
        with pytest.raises(ValueError):
            parse_record(bad)


def test_bom_and_hostile_lines(tmp_path) -> None:  # noqa: ANN001
    from service.files import FileValidationError, validate_jsonl

    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "hello"}).encode() + b"\n")
    assert read_jsonl(p)[0].text == "hello"
    for line, n in (("[" * 100_000 + "]" * 100_000, 2), ('{"text": ' + "9" * 5000 + "}", 2)):
        p.write_text(json.dumps({"text": "ok"}) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=f":{n}:"):
            read_jsonl(p)
        with pytest.raises(FileValidationError, match=f"^line {n}: invalid JSON"):
            validate_jsonl([b'{"text": "ok"}\n', line.encode()])
    bom = [b"\xef\xbb\xbf" + json.dumps({"text": "hello"}).encode() + b"\n"]
    assert validate_jsonl(bom) == ("text", 1)
    with pytest.raises(FileValidationError, match="^line 2: invalid JSON"):
        validate_jsonl([b'{"text": "a"}\n', bom[0]])  # a BOM is only a file's first bytes


def test_service_and_trainer_accept_the_same_records() -> None:
    from service.files import FileValidationError, validate_record

    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    out = [{"role": "assistant", "content": "b"}]
    cases = [
        {"messages": msgs}, {"messages": [msgs[0], {**msgs[1], "weight": 0}]},
        {"messages": [msgs[0], {**msgs[1], "weight": 2}]},
        {"messages": [{**msgs[0], "weight": 1}, msgs[1]]},
        {"messages": [msgs[0], {"role": "assistant", "content": [{"type": "text", "text": "x"}]}]},
        {"messages": [msgs[0], {"role": "assistant", "content": [{"type": "image"}]}]},
        {"messages": [{"role": "tool", "content": "t"}, *msgs], "tools": []},
        {"messages": [msgs[0], {"role": "assistant", "content": None}]},
        {"prompt": "p", "completion": "c"}, {"text": "t"}, {"text": 3},
        {"prompt": "p", "chosen": "c", "rejected": "r"},
        {"input": {"messages": msgs[:1]}, "preferred_output": out, "non_preferred_output": out},
        {"input": {"messages": msgs[:1]}, "preferred_output": out},
        {"input": {"messages": msgs[:1]}, "preferred_output": out * 2,
         "non_preferred_output": out},
        {"unknown": 1}, [1],
    ]
    for case in cases:
        try:
            validate_record(case, 1, None)
            service_ok = True
        except FileValidationError:
            service_ok = False
        try:
            parse_record(case)
            trainer_ok = True
        except ValueError:
            trainer_ok = False
        assert service_ok == trainer_ok, case


def test_truncation_and_fully_truncated_examples(tok) -> None:  # noqa: ANN001
    rec = parse_record({"prompt": "one " * 30, "completion": "two three"})
    full = tokenize_record(tok, rec, 4096)
    assert tokenize_record(tok, rec, 8) is None  # the completion is cut off entirely: dropped
    cut = tokenize_record(tok, rec, len(full.input_ids) - 2)
    assert cut is not None and cut.input_ids == full.input_ids[:-2]
    assert len(tokenize_all(tok, [rec, rec], 8)) == 0


def one_at_a_time(tok, rec, max_seq_len: int) -> Example | None:  # noqa: ANN001
    """The tokenisation rules with one tokenizer call per text (the reference for the batched one)."""
    if rec.text is not None:
        ids = [tok.bos_token_id, *tok(rec.text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
        train = [False] + [True] * (len(ids) - 1)
    elif tok.chat_template:
        msgs = list(rec.messages)
        text = tok.apply_chat_template(msgs, tokenize=False)
        spans = [(len(tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)) if i else 0,
                  len(tok.apply_chat_template(msgs[: i + 1], tokenize=False)))
                 for i, m in enumerate(msgs) if m["role"] == "assistant" and (rec.weights or [1] * len(msgs))[i]]
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        train = [any(s <= a < e for s, e in spans) for a, _ in enc["offset_mapping"]]
    else:
        ids, train = [tok.bos_token_id], [False]
        for m in rec.messages:
            piece = tok(m["content"], add_special_tokens=False)["input_ids"]
            piece += [tok.eos_token_id] if m["role"] == "assistant" else []
            ids, train = ids + piece, train + [m["role"] == "assistant"] * len(piece)
    labels = [t if keep else IGNORE for t, keep in zip(ids[:max_seq_len], train[:max_seq_len], strict=True)]
    ex = Example(tuple(ids[:max_seq_len]), tuple(labels))
    return ex if ex.n_trained > 0 else None


@pytest.mark.parametrize("template", [True, False])
def test_a_file_tokenised_in_batches_equals_one_record_at_a_time(tok, template: bool) -> None:  # noqa: ANN001
    """tokenize_all encodes many records' texts in one tokenizer call (a fast tokenizer's threads):
    the same examples, in order, as encoding every text alone; records with nothing trained
    after truncation are dropped in place, across batch boundaries."""
    rows = [*synthetic_rows(9, seed=4), *synthetic_rows(9, seed=5, fmt="prompt"),
            {"text": "plain text to train on whole"}, {"prompt": "one " * 40, "completion": "cut off"},
            {"messages": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d"},
                          {"role": "user", "content": "e"}, {"role": "assistant", "content": "f g h"}]}]
    records = [parse_record(r) for r in rows]
    records = records[::2] + records[1::2]  # formats interleaved
    with _no_template(tok) if not template else contextlib.nullcontext():
        want = [ex for ex in (one_at_a_time(tok, r, 24) for r in records) if ex is not None]
        for batch in (4096, 3):
            got = tokenize_all(tok, records, 24, batch=batch)
            assert got == want
        assert len(want) < len(records)  # the cut-off record was dropped
        assert tokenize_record(tok, records[0], 24) == one_at_a_time(tok, records[0], 24)


def test_the_backend_encodes_unless_the_call_would_set_it_up_otherwise(tok, monkeypatch) -> None:  # noqa: ANN001
    """tokenize_all encodes through the fast tokenizer's backend, without the call's conversion of
    its encodings, unless the backend truncates, pads or splits special tokens (which the call
    sets up before encoding) or the tokenizer's class encodes its own way: then through the call.
    The same examples every way."""
    from transformers import PreTrainedTokenizerFast

    records = [parse_record(r) for r in synthetic_rows(6, seed=7)]
    calls = []
    encode_plus = PreTrainedTokenizerFast._encode_plus
    monkeypatch.setattr(PreTrainedTokenizerFast, "_encode_plus",
                        lambda self, *a, **k: (calls.append(1), encode_plus(self, *a, **k))[1])
    want = [ex for ex in (one_at_a_time(tok, r, 64) for r in records) if ex is not None]
    assert want and calls  # the reference went through the call
    calls.clear()
    assert tokenize_all(tok, records, 64) == want and calls == []

    class OwnCall(type(tok)):
        def __call__(self, *a, **k):  # noqa: ANN002, ANN003, ANN204
            return super().__call__(*a, **k)

    cls = tok.__class__
    tok.__class__ = OwnCall
    try:
        assert tokenize_all(tok, records, 64) == want and len(calls) == 1
    finally:
        tok.__class__ = cls
    tok.backend_tokenizer.enable_truncation(max_length=4)
    try:
        assert tokenize_all(tok, records, 64) == want and len(calls) == 2  # not cut to 4 tokens: the call's way
    finally:
        tok.backend_tokenizer.no_truncation()


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
