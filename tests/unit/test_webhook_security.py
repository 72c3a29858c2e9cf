"""Unit: webhook signatures are the Standard Webhooks scheme (the reference verifier accepts
them, a changed byte does not), secrets seal and unseal (Fernet, key rotation, plain without a
key), and the address rule refuses every non-public address and pins the one it checked."""

from __future__ import annotations

import base64
import time

import pytest

pytest.importorskip("cryptography")

from cryptography.fernet import Fernet  # noqa: E402

from service.webhooks.catalog import event_body, event_data  # noqa: E402
from service.webhooks.security import (  # noqa: E402
    AddressRefused,
    new_secret,
    resolve,
    seal,
    sign,
    unseal,
)


def test_signature_verifies_with_the_reference_verifier() -> None:
    standardwebhooks = pytest.importorskip("standardwebhooks.webhooks")
    secret = new_secret()
    assert secret.startswith("whsec_") and len(base64.b64decode(secret[6:])) == 32
    body = '{"object":"event","id":"evt_1","type":"task.succeeded","data":{"id":"t ü"}}'.encode()
    now = int(time.time())
    headers = {"webhook-id": "evt_1", "webhook-timestamp": str(now),
               "webhook-signature": sign(secret, "evt_1", now, body)}
    hook = standardwebhooks.Webhook(secret)
    assert hook.verify(body, headers)["data"]["id"] == "t ü"
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        hook.verify(body.replace(b"evt_1", b"evt_2"), headers)
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        hook.verify(body, headers | {"webhook-id": "evt_2"})
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        standardwebhooks.Webhook(new_secret()).verify(body, headers)


def test_secrets_seal_with_the_key_and_rotate() -> None:
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    secret = new_secret()
    sealed = seal(secret, old)
    assert sealed.startswith("fernet:") and secret[6:] not in sealed
    assert unseal(sealed, old) == secret
    assert unseal(sealed, f"{new},{old}") == secret  # rotation: new first, the old still reads
    assert unseal(seal(secret, f"{new},{old}"), new) == secret
    with pytest.raises(ValueError, match="does not decrypt"):
        unseal(sealed, new)
    with pytest.raises(ValueError, match="unset"):
        unseal(sealed, None)
    plain = seal(secret, None)
    assert plain == "plain:" + secret and unseal(plain, old) == secret


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/", "http://127.8.9.1:8080/x", "http://[::1]/", "http://10.0.0.1/",
    "http://172.16.5.4/", "http://192.168.1.1/", "http://169.254.169.254/latest/meta-data",
    "http://100.64.0.1/", "http://0.0.0.0/", "http://224.0.0.251/", "http://240.0.0.1/",
    "http://[fe80::1]/", "http://[fc00::1]/", "http://[::ffff:10.0.0.1]/", "http://[::]/",
    "http://localhost/", "http://2130706433/", "http://0x7f000001/"])
def test_non_public_addresses_are_refused(url: str) -> None:
    with pytest.raises(AddressRefused):
        resolve(url, allow_private=False)


@pytest.mark.parametrize("url", ["ftp://8.8.8.8/", "file:///etc/passwd", "http:///x",
                                 "http://u:p@8.8.8.8/", "http://8.8.8.8:99999/", "8.8.8.8"])
def test_bad_urls_are_refused(url: str) -> None:
    with pytest.raises(AddressRefused):
        resolve(url, allow_private=True)


def test_a_checked_address_is_pinned() -> None:
    target = resolve("https://8.8.8.8/hook?a=1", allow_private=False)
    assert target.url == "https://8.8.8.8:443/hook?a=1" and target.host_header == "8.8.8.8"
    assert target.sni_hostname == "8.8.8.8"
    target = resolve("http://[2001:4860:4860::8888]:8080", allow_private=False)
    assert target.url == "http://[2001:4860:4860::8888]:8080/"
    assert target.host_header == "[2001:4860:4860::8888]:8080" and target.sni_hostname is None
    local = resolve("http://127.0.0.1:9/h", allow_private=True)
    assert local.url == "http://127.0.0.1:9/h" and local.host_header == "127.0.0.1:9"


def test_event_bodies() -> None:
    from datetime import datetime, timezone

    at = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert event_data("fine_tuning.job.failed", "task_1", {"k": "v"}, "boom", None, None) == {
        "id": "task_1"}
    body = event_body("evt_1", "task.failed", at,
                      event_data("task.failed", "task_1", {"k": "v"}, "boom", None, None))
    assert list(body) == ["object", "id", "type", "created_at", "data"]
    assert body["created_at"] == int(at.timestamp())
    assert body["data"] == {"id": "task_1", "object": "task", "state": "failed",
                            "message": "boom", "metadata": {"k": "v"}}
    job = event_data("job.exited", "task_1", None, "", "job_1",
                     {"exit_reason": "overfitting", "best_val_loss": 1.0, "best_step": 3,
                      "attempt": 1})
    assert job["id"] == "job_1" and job["state"] == "exited" and job["task_id"] == "task_1"
