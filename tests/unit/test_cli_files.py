"""Unit: `loraplex files list` renders OpenAI's file object (unix created_at, status)."""

from __future__ import annotations

import httpx
from rich.console import Console

from service.cli import main


def test_files_list_table_reads_the_openai_file_shape() -> None:
    created = 1_767_225_600  # 2026-01-01 00:00:00 UTC
    file = {"id": "file_abc", "object": "file", "bytes": 1234, "created_at": created,
            "filename": "train.jsonl", "purpose": "fine-tune", "status": "processed",
            "status_details": None, "format": "preference", "line_count": 17, "sha256": "00"}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/files"
        return httpx.Response(200, json={"object": "list", "data": [file], "has_more": False})

    console = Console(record=True, width=160)
    assert main(["--api-key", "k", "files", "list"], httpx.MockTransport(handler), console) == 0
    row = next(line for line in console.export_text().splitlines() if "file_abc" in line)
    for cell in ("train.jsonl", "preference", "17", "1234", "processed", "2026-01-01 00:00:00"):
        assert cell in row, (cell, row)
