"""Unit: the Range header of a download (service.api.downloads.byte_range), as RFC 9110 reads it:
one range served, past-the-end refused (416), anything else (several ranges, other units, bad
syntax) ignored so the whole archive is sent."""

from __future__ import annotations

import pytest

from service.api.downloads import byte_range


@pytest.mark.parametrize(("header", "want"), [
    (None, None), ("", None), ("bytes=0-99", (0, 99)), ("bytes=10-", (10, 999)),
    ("bytes=990-5000", (990, 999)), ("bytes=-100", (900, 999)), ("bytes=-5000", (0, 999)),
    ("bytes=999-999", (999, 999)), ("bytes=1000-", False), ("bytes=-0", False),
    ("bytes=5-2", None), ("bytes=0-1,5-6", None), ("items=0-1", None), ("bytes=-", None),
    ("bytes=a-b", None),
])
def test_byte_range(header: str | None, want: object) -> None:
    assert byte_range(header, 1000) == want


def test_empty_archive_has_no_range() -> None:
    assert byte_range("bytes=0-", 0) is False and byte_range("bytes=-1", 0) is False
