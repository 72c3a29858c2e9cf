"""Unit: contract.protocol.tenant_safe, what a tenant may read of an error: the first line (the
last one of a traceback), with paths, URLs and addresses masked, and ordinary text left alone."""

from __future__ import annotations

import pytest

from contract.protocol import tenant_safe


@pytest.mark.parametrize(("raw", "shown"), [
    ("Traceback (most recent call last):\n  File \"/srv/lp/trainer/engine.py\", line 3, in f\n"
     "    x()\nRuntimeError: CUDA error at /srv/lp/spool/p1/state.pt",
     "RuntimeError: CUDA error at <path>"),
    ("ValueError: bad row\nTraceback (most recent call last):\n  File \"/a/b.py\"",
     "ValueError: bad row"),
    ('File "trainer/engine.py", line 10, in step', 'File "<path>", line 10, in step'),
    ("OSError: No such file: 'C:\\models\\x\\config.json'", "OSError: No such file: '<path>'"),
    ("cannot read /home/op/.cache/hf/tok.json", "cannot read <path>"),
    ("redis://:secret@10.0.0.5:6379/0 refused", "<url> refused"),
    ("peer 10.1.2.3:29500 timed out", "peer <address> timed out"),
    ("loss is nan at step 12 (q_proj/v_proj), lr 1e-4 and/or rank 8, v1.2.3",
     "loss is nan at step 12 (q_proj/v_proj), lr 1e-4 and/or rank 8, v1.2.3"),
    ("", ""),
])
def test_tenant_safe(raw: str, shown: str) -> None:
    assert tenant_safe(raw) == shown


def test_limit_and_first_line() -> None:
    assert tenant_safe("x" * 900) == "x" * 500
    assert tenant_safe("\n\n  first  \nsecond") == "first"
