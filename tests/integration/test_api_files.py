"""Integration: /v1/files upload validation, size limit, list/get/content/delete, auth and
tenant isolation, against the real Postgres of conftest.py."""

from __future__ import annotations

import asyncio
import io
import json
import time

from tests.integration.factories import CHAT_LINES, jsonl


def _upload(client, tenant, body: bytes, name: str = "x.jsonl"):  # noqa: ANN001, ANN202
    return client.post("/v1/files", headers=tenant.headers,
                       files={"file": (name, io.BytesIO(body), "application/jsonl")})


def test_upload_each_format(client, factory):  # noqa: ANN001
    t = factory.tenant()
    cases = {
        "chat": CHAT_LINES[:3],
        "completion": [{"prompt": "2+2=", "completion": "4"}] * 2,
        "preference": [{"prompt": "hi", "chosen": "hello!", "rejected": "go away"}],
    }
    for fmt, records in cases.items():
        r = _upload(client, t, jsonl(records) + b"\n")
        assert r.status_code == 201, r.text
        out = r.json()
        assert out["format"] == fmt and out["line_count"] == len(records)
        assert out["id"].startswith("file_") and "storage_key" not in out
        assert out["object"] == "file" and out["status"] == "processed"
        assert isinstance(out["created_at"], int) and abs(out["created_at"] - time.time()) < 120
        assert out["bytes"] == len(jsonl(records) + b"\n") and out["filename"] == "x.jsonl"
        assert out["purpose"] == "fine-tune"
        assert client.get(f"/v1/files/{out['id']}", headers=t.headers).json() == out
        got = client.get(f"/v1/files/{out['id']}/content", headers=t.headers)
        assert got.status_code == 200 and got.content == jsonl(records) + b"\n"


def test_bad_line_names_line_and_field(client, factory):  # noqa: ANN001
    t = factory.tenant()
    bad_role = CHAT_LINES[:2] + [{"messages": [{"role": "robot", "content": "x"}]}]
    r = _upload(client, t, jsonl(bad_role))
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "invalid_file" and "line 3" in err["message"]
    assert "messages[0].role" in err["message"]

    r = _upload(client, t, jsonl([{"prompt": "a", "completion": "b"}, {"prompt": "a"}]))
    assert r.status_code == 422 and "line 2" in r.json()["error"]["message"]
    assert "'completion'" in r.json()["error"]["message"]

    r = _upload(client, t, b'{"prompt": "a", "completion": "b"}\n{not json}\n')
    assert r.status_code == 422 and "line 2" in r.json()["error"]["message"]

    mixed = [{"prompt": "a", "completion": "b"}, CHAT_LINES[0]]
    r = _upload(client, t, jsonl(mixed))
    assert r.status_code == 422 and "line 2" in r.json()["error"]["message"]

    r = _upload(client, t, b"\n\n")
    assert r.status_code == 422
    assert client.get("/v1/files", headers=t.headers).json()["data"] == []


def test_size_limit_413(client, factory, settings):  # noqa: ANN001
    t = factory.tenant()
    line = jsonl([{"prompt": "p" * 1000, "completion": "c"}])
    body = line * (settings.max_upload_bytes // len(line) + 2)
    r = _upload(client, t, body)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "file_too_large"
    # Far over the limit: refused from Content-Length before the body is read.
    r = _upload(client, t, line * (4 * settings.max_upload_bytes // len(line)))
    assert r.status_code == 413 and "over the limit" in r.json()["error"]["message"]
    assert client.get("/v1/files", headers=t.headers).json()["data"] == []


def test_list_paginates_newest_first(client, factory):  # noqa: ANN001
    t = factory.tenant()
    ids = [factory.file(t, CHAT_LINES[:n])["id"] for n in range(1, 6)]  # 5 distinct files
    seen, after = [], None
    while True:
        params = {"limit": 2} | ({"after": after} if after else {})
        page = client.get("/v1/files", headers=t.headers, params=params).json()
        seen += [f["id"] for f in page["data"]]
        assert len(page["data"]) <= 2
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == ids[::-1]
    r = client.get("/v1/files", headers=t.headers, params={"after": "file_nope"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "after"


def test_same_bytes_and_purpose_answer_the_existing_file(client, factory):  # noqa: ANN001
    """Uploads are deduplicated by content per tenant: the same bytes with the same purpose
    answer 200 with the file already stored (nothing new stored); another purpose, another
    tenant or a deleted file make a new one (201)."""
    t, other = factory.tenant(), factory.tenant()
    body = jsonl(CHAT_LINES)
    first = _upload(client, t, body, name="a.jsonl")
    assert first.status_code == 201, first.text
    for _ in range(3):  # as the README tour's creates did
        again = _upload(client, t, body, name="b.jsonl")
        assert again.status_code == 200 and again.json() == first.json()
    assert [f["id"] for f in client.get("/v1/files", headers=t.headers).json()["data"]] \
        == [first.json()["id"]]
    other_purpose = client.post("/v1/files", headers=t.headers, data={"purpose": "eval"},
                                files={"file": ("a.jsonl", io.BytesIO(body))})
    assert other_purpose.status_code == 201 and other_purpose.json()["id"] != first.json()["id"]
    elsewhere = _upload(client, other, body)
    assert elsewhere.status_code == 201 and elsewhere.json()["id"] != first.json()["id"]
    assert client.delete(f"/v1/files/{first.json()['id']}", headers=t.headers).status_code == 200
    fresh = _upload(client, t, body)
    assert fresh.status_code == 201 and fresh.json()["id"] != first.json()["id"]
    got = client.get(f"/v1/files/{fresh.json()['id']}/content", headers=t.headers)
    assert got.content == body
    # bad bytes are refused whether or not they were seen before
    assert _upload(client, t, b"{nope}\n").status_code == 422
    assert _upload(client, t, b"{nope}\n").status_code == 422


def test_delete_and_in_use(client, factory):  # noqa: ANN001
    t = factory.tenant()
    f = factory.file(t)
    task = factory.task(t, f["id"])
    r = client.delete(f"/v1/files/{f['id']}", headers=t.headers)
    assert r.status_code == 409 and r.json()["error"]["code"] == "file_in_use"
    assert client.post(f"/v1/tasks/{task['id']}/cancel", headers=t.headers).status_code == 200
    r = client.delete(f"/v1/files/{f['id']}", headers=t.headers)
    assert r.status_code == 200 and r.json() == {"id": f["id"], "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{f['id']}", headers=t.headers).status_code == 404
    assert client.delete(f"/v1/files/{f['id']}", headers=t.headers).status_code == 404


def test_auth_and_tenant_isolation(client, factory):  # noqa: ANN001
    a, b = factory.tenant(), factory.tenant()
    f = factory.file(a)
    assert client.get("/v1/files").status_code == 401
    r = client.get("/v1/files", headers={"Authorization": "Bearer lpx-0000000000nottherealkey"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/files", headers={"Authorization": f"Bearer {a.key}x"}).status_code == 401
    for method, path in [("get", f"/v1/files/{f['id']}"), ("get", f"/v1/files/{f['id']}/content"),
                         ("delete", f"/v1/files/{f['id']}")]:
        r = getattr(client, method)(path, headers=b.headers)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert client.get("/v1/files", headers=b.headers).json()["data"] == []
    assert client.get(f"/v1/files/{f['id']}", headers=a.headers).status_code == 200


def test_upload_without_file_is_422(client, factory):  # noqa: ANN001
    t = factory.tenant()
    r = client.post("/v1/files", headers=t.headers, data={"purpose": "fine-tune"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "file"


def _nothing_stored(client, t) -> None:  # noqa: ANN001
    assert client.get("/v1/files", headers=t.headers).json()["data"] == []


def test_peer_formats_bom_and_parts(client, factory):  # noqa: ANN001
    t = factory.tenant()
    parts = [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    cases = {
        "chat": [{"messages": [{"role": "user", "content": parts},
                               {"role": "assistant", "content": "x", "weight": 0},
                               {"role": "user", "content": "again"},
                               {"role": "assistant", "content": parts, "weight": 1}]},
                 {"tools": [{"type": "function", "function": {"name": "f"}}], "messages": [
                     {"role": "user", "content": "q"},
                     {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c", "content": "42"},
                     {"role": "assistant", "content": "it is 42"}]}],
        "preference": [{"input": {"messages": [{"role": "user", "content": "hi"}]},
                        "preferred_output": [{"role": "assistant", "content": "hello"}],
                        "non_preferred_output": [{"role": "assistant", "content": parts}]}] * 2,
        "text": [{"text": "one"}, {"text": "two"}],
    }
    for fmt, records in cases.items():
        r = _upload(client, t, b"\xef\xbb\xbf" + jsonl(records))
        assert r.status_code == 201, r.text
        assert (r.json()["format"], r.json()["line_count"]) == (fmt, len(records))
    text_file = client.get("/v1/files", headers=t.headers).json()["data"][0]
    assert text_file["format"] == "text"
    # text files train SFT; preference files DPO only
    r = client.post("/v1/tasks", headers=t.headers, json={
        "base_model": "tiny-llama", "training_file": text_file["id"], "method": "dpo"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "training_file"


def test_peer_format_errors_name_line_and_field(client, factory):  # noqa: ANN001
    t = factory.tenant()
    good = {"text": "fine"}
    pref_ok = {"input": {"messages": [{"role": "user", "content": "hi"}]},
               "preferred_output": [{"role": "assistant", "content": "a"}],
               "non_preferred_output": [{"role": "assistant", "content": "b"}]}
    cases = [
        ([good, {"prompt": "p", "completion": "c"}], "line 2", "the file is text"),
        ([pref_ok, good], "line 2", "the file is preference"),
        ([good, {"text": "x", "messages": []}], "line 2", "several formats"),
        ([{"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a", "weight": 0}]}], "line 1",
         "weight 1"),
        ([{"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a", "weight": 0.5}]}], "line 1",
         "messages[1].weight"),
        ([{"messages": [{"role": "user", "content": [{"type": "image_url"}]},
                        {"role": "assistant", "content": "a"}]}], "line 1",
         "messages[0].content[0]"),
        ([pref_ok, {**pref_ok, "preferred_output": []}], "line 2", "preferred_output"),
        ([pref_ok, {**pref_ok, "non_preferred_output": [{"role": "user", "content": "b"}]}],
         "line 2", "non_preferred_output[0].role"),
        ([good, {"text": ""}], "line 2", "'text'"),
    ]
    for records, line, field in cases:
        r = _upload(client, t, jsonl(records))
        assert r.status_code == 422, (records, r.text)
        msg = r.json()["error"]["message"]
        assert msg.startswith(line) and field in msg, (records, msg)
    _nothing_stored(client, t)


def test_hostile_lines_are_422_naming_the_line(client, factory):  # noqa: ANN001
    t = factory.tenant()
    first = jsonl([{"text": "ok"}])
    # (100,000 deep is over this app's 64 KiB limit: 30,000 is as far past the parser's recursion;
    # tests/unit/test_data.py checks 100,000 on the validator)
    for line, reason in ((b"[" * 30_000 + b"]" * 30_000, "nested too deeply"),
                         (b'{"text": ' + b"9" * 5000 + b"}", "number is too long"),
                         (b'{"text": NaN}', "NaN"),
                         (b'{"text": "a\\ud800"}', None)):
        r = _upload(client, t, first + line + b"\n")
        if reason is None:  # a lone surrogate is valid JSON; the record is still text
            assert r.status_code in (201, 422), r.text
            if r.status_code == 201:
                assert client.delete(f"/v1/files/{r.json()['id']}",
                                     headers=t.headers).status_code == 200
            continue
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["param"] == "file" and err["message"].startswith("line 2") \
            and reason in err["message"], err
    _nothing_stored(client, t)


def _asgi_upload(app, headers: dict[str, str], total: int, size: int) -> tuple[int, dict, int]:  # noqa: ANN001
    """POST /v1/files straight to the ASGI app: a multipart body of about `total` bytes in
    `size` chunks with no Content-Length (chunked). Returns the status, the JSON body and how
    many body bytes the app asked for before it answered."""
    head = (b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.jsonl\"\r\n"
            b"Content-Type: application/jsonl\r\n\r\n")
    line = jsonl([{"prompt": "p" * 200, "completion": "c"}])
    block = line * max(1, size // len(line))
    chunks = [head] + [block] * (total // len(block) + 1) + [b"\r\n--B--\r\n"]
    pulled, out = [0], {"status": 0, "body": b""}

    async def receive() -> dict:
        if not chunks:
            return {"type": "http.disconnect"}
        chunk = chunks.pop(0)
        pulled[0] += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")

    hdrs = {"content-type": "multipart/form-data; boundary=B",
            "transfer-encoding": "chunked"} | {k.lower(): v for k, v in headers.items()}
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/files", "raw_path": b"/v1/files", "query_string": b"",
             "root_path": "", "headers": [(k.encode(), v.encode()) for k, v in hdrs.items()],
             "client": ("127.0.0.1", 1), "server": ("test", 80), "state": {}}
    asyncio.run(app(scope, receive, send))
    return out["status"], json.loads(out["body"]), pulled[0]


def test_chunked_upload_stops_at_the_limit(app, client, factory, settings):  # noqa: ANN001
    t = factory.tenant()
    limit = settings.max_upload_bytes
    status, body, pulled = _asgi_upload(app, t.headers, 50 * limit, 8192)
    assert status == 413 and body["error"]["code"] == "file_too_large", body
    # the body was read only up to the limit (+ the multipart allowance and one chunk), not the
    # 50x sent
    assert limit < pulled <= limit + 65536 + 8192, pulled
    # no key, or a wrong one: a 401 before a byte of the body is read
    for auth in ({}, {"Authorization": "Bearer lpx-0000000000nottherealkey"}):
        status, body, pulled = _asgi_upload(app, auth, 50 * limit, 8192)
        assert status == 401 and pulled == 0, (status, body, pulled)
    # chunked and under the limit: stored
    status, body, _ = _asgi_upload(app, t.headers, limit // 2, 4096)
    assert status == 201, body
    assert body["format"] == "completion" and limit // 2 <= body["bytes"] < limit
    assert client.delete(f"/v1/files/{body['id']}", headers=t.headers).status_code == 200
    _nothing_stored(client, t)


def test_malformed_multipart_is_422(client, factory):  # noqa: ANN001
    t = factory.tenant()
    for ctype, body in (("multipart/form-data", b"--x\r\n"),
                        ("application/json", json.dumps({"file": "x"}).encode()),
                        ("multipart/form-data; boundary=B", b"garbage")):
        r = client.post("/v1/files", headers=t.headers | {"Content-Type": ctype}, content=body)
        assert r.status_code == 422, (ctype, r.text)
        assert r.json()["error"]["param"] == "file"
    r = client.post("/v1/files", headers=t.headers,
                    files={"file": ("x.jsonl", io.BytesIO(jsonl([{"text": "a"}])))},
                    data={"purpose": "p" * 33})
    assert r.status_code == 422 and r.json()["error"]["param"] == "purpose"
    _nothing_stored(client, t)


def _adapter_upload(client, tenant, body: bytes):  # noqa: ANN001, ANN202
    return client.post("/v1/files", headers=tenant.headers, data={"purpose": "adapter"},
                       files={"file": ("a.tar.gz", io.BytesIO(body), "application/gzip")})


def test_upload_adapter_archive(client, factory):  # noqa: ANN001
    from tests.unit.test_adapter_archive import _files, _tar, _weights

    t = factory.tenant()
    body = _tar(_files())
    r = _adapter_upload(client, t, body)
    assert r.status_code == 201, r.text
    out = r.json()
    assert out["purpose"] == "adapter" and out["format"] == "adapter"
    assert out["line_count"] == 4  # 2 layers x (q_proj, v_proj)
    got = client.get(f"/v1/files/{out['id']}/content", headers=t.headers)
    assert got.status_code == 200 and got.content == body
    before = client.get("/v1/files", headers=t.headers).json()["data"]
    for bad in (b"plain text", _tar({"adapter_config.json": b"{}"}),
                _tar(_files(**{"adapter_model.safetensors": _weights(bad_rank=True)}))):
        r = _adapter_upload(client, t, bad)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == "file" and "adapter" in r.json()["error"]["message"]
    assert client.get("/v1/files", headers=t.headers).json()["data"] == before


def test_cli_creates_reuse_uploads_and_a_failed_create_removes_its_own(
        client, factory, tmp_path) -> None:  # noqa: ANN001
    """`loraplex tasks create --train f.jsonl`, run again and again, keeps one copy of f.jsonl
    (the upload answers the file the tenant has); a create that fails (422) removes what that
    create uploaded, and keeps a file the tenant already had."""
    import httpx
    from rich.console import Console

    from service.cli import main

    t = factory.tenant()
    train, fresh, val = tmp_path / "f.jsonl", tmp_path / "g.jsonl", tmp_path / "v.jsonl"
    train.write_bytes(jsonl(CHAT_LINES))
    fresh.write_bytes(jsonl(CHAT_LINES[:5]))
    val.write_bytes(jsonl(CHAT_LINES[5:8]))

    class Via(httpx.BaseTransport):  # the CLI's httpx client, served by the app's TestClient
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            r = client.request(request.method, str(request.url), headers=request.headers,
                               content=request.read())
            return httpx.Response(r.status_code, content=r.content,
                                  headers={"content-type": r.headers.get("content-type", "")})

    def cli(*argv: str) -> int:
        return main(["--api-url", "http://testserver", "--api-key", t.key, "tasks", "create",
                     "--max-seq-len", "128", *argv], transport=Via(),
                    console=Console(record=True))

    def files() -> list[str]:
        return [f["filename"] for f in client.get("/v1/files", headers=t.headers).json()["data"]]

    for _ in range(4):
        assert cli("--model", "tiny-llama", "--train", str(train), "--rank", "4") == 0
    assert files() == ["f.jsonl"]
    assert len(client.get("/v1/tasks", headers=t.headers).json()["data"]) == 4
    # unknown model: a 422 at create; g.jsonl and v.jsonl were stored by this create: removed
    assert cli("--model", "nope", "--train", str(fresh), "--validation", str(val)) == 1
    assert files() == ["f.jsonl"]
    # a failed create that reused f.jsonl keeps it (other tasks use it)
    assert cli("--model", "nope", "--train", str(train), "--validation", str(val)) == 1
    assert files() == ["f.jsonl"]
    assert len(client.get("/v1/tasks", headers=t.headers).json()["data"]) == 4
