"""Webhook secrets (``whsec_<base64 of 32 random bytes>``, shown once, encrypted at rest with
LORAPLEX_WEBHOOK_SECRET_KEY when set), Standard Webhooks signatures, and the address rule that
keeps the service from posting into its own network (SSRF). ``python -m
service.webhooks.security`` prints a new key for LORAPLEX_WEBHOOK_SECRET_KEY."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import logging
import secrets
import socket
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit, urlunsplit

import httpx
from cryptography.fernet import Fernet, InvalidToken, MultiFernet

log = logging.getLogger("loraplex.webhooks")

SECRET_PREFIX = "whsec_"
_FERNET, _PLAIN = "fernet:", "plain:"


def new_secret() -> str:
    """A signing secret as Standard Webhooks writes it: whsec_ + base64 of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


@lru_cache(maxsize=8)
def _fernet(keys: str) -> MultiFernet:
    return MultiFernet([Fernet(k.strip().encode()) for k in keys.split(",") if k.strip()])


def check_key(keys: str | None) -> None:
    """Raise ValueError unless keys is unset or a comma-separated list of Fernet keys."""
    if keys:
        try:
            _fernet(keys)
        except ValueError as exc:
            raise ValueError("LORAPLEX_WEBHOOK_SECRET_KEY is not a comma-separated list of "
                             "Fernet keys (python -m service.webhooks.security prints one)"
                             ) from exc


def seal(secret: str, keys: str | None) -> str:
    """The secret as stored: encrypted with the first key, or as it is without one."""
    if not keys:
        return _PLAIN + secret
    return _FERNET + _fernet(keys).encrypt(secret.encode()).decode()


def unseal(stored: str, keys: str | None) -> str:
    """The secret from its stored form; ValueError when it was encrypted with no key given."""
    if stored.startswith(_PLAIN):
        return stored[len(_PLAIN):]
    if not keys:
        raise ValueError("webhook secret is encrypted but LORAPLEX_WEBHOOK_SECRET_KEY is unset")
    try:
        return _fernet(keys).decrypt(stored[len(_FERNET):].encode()).decode()
    except InvalidToken as exc:
        raise ValueError("webhook secret does not decrypt with LORAPLEX_WEBHOOK_SECRET_KEY") from exc


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The webhook-signature header: ``v1,<base64 HMAC-SHA256(key, "{id}.{timestamp}.{body}")>``
    with the key base64-decoded from after ``whsec_`` (the Standard Webhooks scheme)."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


class AddressRefused(ValueError):
    """The URL may not be posted to (scheme, host, or an address of a forbidden kind)."""


def _forbidden(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_multicast
            or ip.is_reserved or ip.is_unspecified or not ip.is_global)


@dataclass(frozen=True)
class Target:
    """Where one attempt connects: the URL with its host replaced by the address checked (so a
    DNS answer that changes between the check and the connect cannot redirect it), and the
    Host header and TLS server name of the original host."""

    url: str
    host_header: str
    sni_hostname: str | None


def check_url_shape(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL with a host and no credentials."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise AddressRefused(f"not a valid URL: {exc}") from exc
    if parts.scheme not in ("http", "https"):
        raise AddressRefused("only http and https URLs are allowed")
    if not parts.hostname:
        raise AddressRefused("the URL has no host")
    if parts.username is not None or parts.password is not None:
        raise AddressRefused("the URL may not carry credentials")
    try:  # what the HTTP client could not send is refused now, not at every attempt
        httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise AddressRefused(f"not a valid URL: {exc}") from exc
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def resolve(url: str, allow_private: bool,
            setting: str = "LORAPLEX_WEBHOOK_ALLOW_PRIVATE") -> Target:
    """Check the URL and resolve its host: refused when any address it resolves to is loopback,
    private, link-local, multicast, reserved or otherwise not global, unless allow_private (the
    operator's `setting`, named in the refusal; tracking servers have their own)."""
    scheme, host, port = check_url_shape(url)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as exc:  # unknown, undecodable, a NUL byte
        raise AddressRefused(f"host {host!r} does not resolve") from exc
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not addresses:
        raise AddressRefused(f"host {host!r} does not resolve")
    if not allow_private:
        # The address itself is not told: it would map the operator's network for the tenant.
        if any(_forbidden(a) for a in addresses):
            raise AddressRefused(f"host {host!r} resolves to a loopback, private or reserved "
                                 f"address (the operator's {setting} allows them)")
    ip = addresses[0]
    parts = urlsplit(url)
    netloc_ip = f"[{ip}]" if ip.version == 6 else str(ip)
    pinned = urlunsplit((scheme, f"{netloc_ip}:{port}", parts.path or "/", parts.query, ""))
    default_port = port == (443 if scheme == "https" else 80)
    host_header = (f"[{host}]" if ":" in host else host) + ("" if default_port else f":{port}")
    return Target(url=pinned, host_header=host_header,
                  sni_hostname=host if scheme == "https" else None)


if __name__ == "__main__":
    print(Fernet.generate_key().decode())
