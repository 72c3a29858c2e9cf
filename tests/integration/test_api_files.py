"""Integration: /v1/files upload validation, size limit, list/get/content/delete, auth and
tenant isolation, against the real Postgres of conftest.py."""

from __future__ import annotations

import io

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
    ids = [factory.file(t)["id"] for _ in range(5)]
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
