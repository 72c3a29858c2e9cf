"""Unit: the quick start's local stack lets a user try webhooks and tracking against loopback
receivers (issue 43): `localstack env` writes var/loraplex.env with the development settings on
(logged; a caller's false wins), the API logs them at start, the deployment files keep them off,
and the tour's receiver (service.dev.webhook_receiver) verifies Standard Webhooks signatures."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.core import localstack
from service.core.config import Settings
from service.dev import webhook_receiver
from service.webhooks.security import new_secret, sign

REPO = Path(__file__).resolve().parents[2]
PRIVATE = ("LORAPLEX_WEBHOOK_ALLOW_PRIVATE", "LORAPLEX_TRACKING_ALLOW_PRIVATE")


def sourced(env_file: Path, *names: str) -> list[str]:
    script = f"source {env_file} && " + " && ".join(f'echo "${name}"' for name in names)
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                          env={"PATH": "/usr/bin:/bin"})
    return done.stdout.splitlines()


@pytest.fixture
def stack_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PRIVATE + ("LORAPLEX_WANDB_DIR",):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", "postgresql+psycopg://loraplex@127.0.0.1:55432/x")
    monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://127.0.0.1:56379/0")
    monkeypatch.setenv("LORAPLEX_WORKER_TOKEN", "tok with 'quotes' and $dollar")


def test_env_file_records_the_development_settings_and_logs_them(
        tmp_path: Path, stack_env: None, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert localstack.main(["env", str(tmp_path), "--api-url", "http://127.0.0.1:8123"]) == 0
    logged = capsys.readouterr().err
    for name in PRIVATE:
        assert f"development setting {name}=true" in logged
    env_file = tmp_path / "loraplex.env"
    assert "development settings" in env_file.read_text()
    got = sourced(env_file, *PRIVATE, "LORAPLEX_API_URL", "LORAPLEX_WORKER_TOKEN",
                  "LORAPLEX_WANDB_DIR", "LORAPLEX_REDIS_URL")
    assert got == ["true", "true", "http://127.0.0.1:8123", "tok with 'quotes' and $dollar",
                   str(tmp_path.resolve() / "wandb"), "redis://127.0.0.1:56379/0"]
    for name in PRIVATE:  # what the API reads from that environment
        monkeypatch.setenv(name, "true")
    settings = Settings(_env_file=None)
    assert settings.webhook_allow_private and settings.tracking_allow_private


def test_a_callers_false_wins(tmp_path: Path, stack_env: None,
                              capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_WEBHOOK_ALLOW_PRIVATE", "false")
    localstack.main(["env", str(tmp_path)])
    logged = capsys.readouterr().err
    assert "LORAPLEX_WEBHOOK_ALLOW_PRIVATE" not in logged
    assert "LORAPLEX_TRACKING_ALLOW_PRIVATE=true" in logged
    assert sourced(tmp_path / "loraplex.env", *PRIVATE) == ["false", "true"]


def test_the_quick_start_writes_that_file_and_serves_with_it() -> None:
    script = (REPO / "scripts" / "loraplex-up.sh").read_text()
    writes = script.index("-m service.core.localstack env var")
    reads = script.index("\nsource var/loraplex.env\n")
    assert writes < reads < script.index("-m service.api.serve")
    assert "> var/loraplex.env" not in script  # one writer of the file


def test_the_deployment_files_keep_loopback_receivers_off() -> None:
    files = [REPO / "docker-compose.yml", REPO / "Dockerfile",
             *(p for p in (REPO / "deploy").rglob("*") if p.is_file())]
    for path in files:
        text = "\n".join(line for line in path.read_text().splitlines()
                         if not line.lstrip().startswith("#"))
        on = re.findall(r"ALLOW_PRIVATE\W{1,3}(?:true|1|yes|on)\b", text, re.IGNORECASE)
        assert not on, f"{path.relative_to(REPO)} turns on {on}"
    example = (REPO / "deploy" / "loraplex.env.example").read_text()
    assert "LORAPLEX_WEBHOOK_ALLOW_PRIVATE=false" in example
    assert "LORAPLEX_TRACKING_ALLOW_PRIVATE=false" in example


def test_the_api_logs_the_development_settings(caplog: pytest.LogCaptureFixture) -> None:
    from service.api.app import log_development_settings

    with caplog.at_level(logging.WARNING, logger="loraplex.api"):
        log_development_settings(Settings(_env_file=None))
        assert not caplog.records
        log_development_settings(Settings(_env_file=None, webhook_allow_private=True,
                                          tracking_allow_private=True))
    text = caplog.text
    assert "development setting LORAPLEX_WEBHOOK_ALLOW_PRIVATE=true" in text
    assert "development setting LORAPLEX_TRACKING_ALLOW_PRIVATE=true" in text


# ----- the tour's receiver ---------------------------------------------------------------------
@pytest.fixture
def receiver() -> Iterator[tuple[str, str, io.StringIO]]:
    secret, out = new_secret(), io.StringIO()
    server = webhook_receiver.make_server("127.0.0.1", 0, secret, out)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", secret, out
    server.shutdown()
    server.server_close()


def post(url: str, secret: str, body: bytes, msg_id: str = "evt_1",
         stamp: int | None = None) -> httpx.Response:
    stamp = int(time.time()) if stamp is None else stamp
    return httpx.post(url, content=body, headers={
        "webhook-id": msg_id, "webhook-timestamp": str(stamp),
        "webhook-signature": sign(secret, msg_id, stamp, body)}, timeout=5)


def test_the_receiver_verifies_signatures_and_prints_events(receiver) -> None:  # noqa: ANN001
    url, secret, out = receiver
    body = json.dumps({"object": "event", "id": "evt_1", "type": "webhook.test",
                       "data": {"id": "whep_1"}}).encode()
    assert post(url, secret, body).status_code == 204
    assert out.getvalue().splitlines() == ['verified evt_1 webhook.test {"id": "whep_1"}']
    other = new_secret()
    assert post(url, other, body, "evt_2").status_code == 401
    assert post(url, secret, body, "evt_3", stamp=int(time.time()) - 3600).status_code == 401
    assert httpx.post(url, content=body, timeout=5).status_code == 401
    lines = out.getvalue().splitlines()[1:]
    assert lines[0] == "REFUSED evt_2: no signature matches the secret"
    assert lines[1].startswith("REFUSED evt_3: timestamp too far from now")
    assert lines[2].startswith("REFUSED -: missing webhook-id")


def test_the_receiver_agrees_with_the_reference_verifier() -> None:
    standardwebhooks = pytest.importorskip("standardwebhooks.webhooks")
    secret = new_secret()
    body = b'{"type": "webhook.test"}'
    stamp = int(time.time())
    headers = {"webhook-id": "evt_9", "webhook-timestamp": str(stamp),
               "webhook-signature": sign(secret, "evt_9", stamp, body)}
    standardwebhooks.Webhook(secret).verify(body, headers)
    webhook_receiver.verify(secret, headers, body)
    with pytest.raises(webhook_receiver.Refused):
        webhook_receiver.verify(secret, headers, body + b" ")
