"""Unit: JSONL validation (formats, line numbers, fields), grid expansion, request hashing and
LocalStorage — no database needed."""

from __future__ import annotations

import hashlib
import io
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.core.storage import LocalStorage
from service.files import FileValidationError, validate_jsonl
from service.idempotency import request_hash
from service.schemas import SearchSpace
from service.tasks import expand_grid


def _lines(records: list) -> list[bytes]:
    return [(json.dumps(r) + "\n").encode() for r in records]


def test_formats_detected() -> None:
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                         {"role": "assistant", "content": "a"}]}
    assert validate_jsonl(_lines([chat, chat])) == ("chat", 2)
    assert validate_jsonl(_lines([{"prompt": "p", "completion": "c"}])) == ("completion", 1)
    pref = {"prompt": "p", "chosen": "c", "rejected": "r"}
    assert validate_jsonl(_lines([pref]) + [b"\n", b"  \n"]) == ("preference", 1)


@pytest.mark.parametrize(("record", "field"), [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": "u"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "u"}, "x"]}, "messages[1]"),
    ({"prompt": "p"}, "completion"),
    ({"prompt": "p", "completion": 5}, "completion"),
    ({"prompt": "p", "chosen": "c"}, "rejected"),
    ({"prompt": " ", "chosen": "c", "rejected": "r"}, "prompt"),
])
def test_bad_record_names_field(record: dict, field: str) -> None:
    good = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    if "messages" not in record:
        good = {"prompt": "p", "completion": "c"} if "chosen" not in record else \
            {"prompt": "p", "chosen": "c", "rejected": "r"}
    with pytest.raises(FileValidationError) as exc:
        validate_jsonl(_lines([good, good, record]))
    assert exc.value.line == 3 and exc.value.field == field
    assert str(exc.value).startswith(f"line 3, field '{field}'")


def test_not_json_not_object_not_utf8() -> None:
    for raw, line in [([b'{"prompt": "p", "completion": "c"}\n', b"[1]\n"], 2),
                      ([b"{oops\n"], 1), ([b"\xff\xfe\n"], 1), ([b"\n", b"\n"], 1),
                      ([b'{"body": "x"}\n'], 1)]:
        with pytest.raises(FileValidationError) as exc:
            validate_jsonl(raw)
        assert exc.value.line == line


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(min_size=1).filter(str.strip), min_size=1, max_size=8))
def test_any_text_roundtrips_as_completion(texts: list[str]) -> None:
    records = [{"prompt": t, "completion": t[::-1] or "x"} for t in texts]
    records = [r for r in records if r["completion"].strip()]
    if records:
        assert validate_jsonl(_lines(records)) == ("completion", len(records))


def test_grid_is_cartesian_product_in_order() -> None:
    space = SearchSpace(learning_rate=[1e-4, 2e-4], lora_rank=[4, 8, 16], lora_alpha=[8],
                        batch_size=[1, 2]).model_dump()
    grid = expand_grid(space)
    assert len(grid) == 12 and len({json.dumps(g, sort_keys=True) for g in grid}) == 12
    want = itertools.product([1e-4, 2e-4], [4, 8, 16], [8], [1, 2])
    assert [tuple(g.values()) for g in grid] == list(want)


def test_request_hash_ignores_key_order_not_values() -> None:
    """The digest of what the client sent (parsed JSON, keys sorted at every level), with no
    default filled in: a setting added by an upgrade changes no digest of a body without it."""
    a = {"base_model": "m", "training_file": "f", "seed": 1, "eval": {"x": 1, "y": [2, 3]}}
    b = {"eval": {"y": [2, 3], "x": 1}, "seed": 1, "training_file": "f", "base_model": "m"}
    c = a | {"seed": 2}
    assert request_hash(a) == request_hash(b) != request_hash(c)
    raw = json.dumps(a, sort_keys=True, separators=(",", ":")).encode()
    assert request_hash(a) == hashlib.sha256(raw).hexdigest()


def test_local_storage(tmp_path) -> None:  # noqa: ANN001
    st_ = LocalStorage(tmp_path)
    assert st_.put("a/b.bin", io.BytesIO(b"x" * 3_000_000)) == 3_000_000
    assert st_.exists("a/b.bin") and st_.size("a/b.bin") == 3_000_000
    assert b"".join(st_.iter_bytes("a/b.bin")) == b"x" * 3_000_000
    st_.put("a/b.bin", io.BytesIO(b"new"))
    assert st_.open("a/b.bin").read() == b"new"
    st_.delete("a/b.bin")
    st_.delete("a/b.bin")
    assert not st_.exists("a/b.bin")
    with pytest.raises(ValueError):
        st_.put("../escape", io.BytesIO(b""))


# Bodies and the Idempotency-Key digests the previous release (0c6718c) stored for them, as its
# own request_hash printed them: a key claimed before this upgrade must still replay after it.
PREVIOUS_RELEASE_DIGESTS = [
    ({"base_model": "tiny-llama", "training_file": "file_" + "0" * 24, "max_seq_len": 64},
     "55ed96b1a890d30150c23f0455b0e1c00bb5eb52d6fa76e669683c94f03549de"),
    ({"base_model": "tiny-llama", "training_file": "file_" + "1" * 24,
      "search_space": {"learning_rate": [1e-4, 3e-4], "lora_rank": [4, 8]}, "epochs": 2,
      "eval": {"eval_every_steps": 20}},
     "891777e476f81863f1ed4fa8e44344d904fe6a381a967fd926d84b2527ec4d19"),
    ({"base_model": "tiny-llama", "training_file": "file_" + "2" * 24, "suffix": "x",
      "eval": {"eval_every_samples": 512, "eval_max_samples": 100}, "integrations": []},
     "98427995f5238ad3221439867009f6848416414643acd2c3e15f6f747a1367a8"),
]


@pytest.mark.parametrize(("body", "digest"), PREVIOUS_RELEASE_DIGESTS)
def test_keys_stored_by_the_previous_release_still_replay(body: dict, digest: str) -> None:
    from service.idempotency import accepted_digests
    from service.schemas import TaskCreate

    assert digest in accepted_digests(TaskCreate.model_validate(body))
