"""``python -m service.dev.webhook_receiver --secret whsec_...``: a webhook receiver to try the
service's webhooks on the local stack (loraplex-up.sh allows loopback receivers). It verifies
each POST's Standard Webhooks signature and prints one line per event; standard library only."""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import hmac
import json
import sys
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TextIO

TOLERANCE_S = 5 * 60  # Standard Webhooks: refuse a timestamp further than this from now
MAX_BODY = 1024 * 1024


class Refused(ValueError):
    """The request is not a correctly signed webhook: why."""


def verify(secret: str, headers: Mapping[str, str], body: bytes,
           now: float | None = None) -> None:
    """Check the webhook-id / webhook-timestamp / webhook-signature headers (lower-case names)
    against `secret` (``whsec_<base64 key>``) as Standard Webhooks define them; raises Refused."""
    msg_id, stamp = headers.get("webhook-id"), headers.get("webhook-timestamp")
    signatures = headers.get("webhook-signature")
    if not (msg_id and stamp and signatures):
        raise Refused("missing webhook-id, webhook-timestamp or webhook-signature header")
    try:
        sent = int(stamp)
        key = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except (ValueError, binascii.Error) as exc:
        raise Refused(f"bad timestamp or secret: {exc}") from exc
    if abs((time.time() if now is None else now) - sent) > TOLERANCE_S:
        raise Refused("timestamp too far from now (a replay, or a clock off by over 5 minutes)")
    mac = hmac.new(key, f"{msg_id}.{sent}.".encode() + body, hashlib.sha256).digest()
    expected = base64.b64encode(mac).decode()
    for item in signatures.split():
        version, _, value = item.partition(",")
        if version == "v1" and hmac.compare_digest(value, expected):
            return
    raise Refused("no signature matches the secret")


def describe(body: bytes) -> str:
    """One line of an event: its type, what it is about, and its data."""
    try:
        event = json.loads(body)
        data = event.get("data") or {}
        return f"{event.get('type')} {json.dumps(data, sort_keys=True)}"
    except (ValueError, AttributeError):
        return f"(not a JSON event: {len(body)} bytes)"


def handler(secret: str | None, out: TextIO) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            length = int(self.headers.get("content-length") or 0)
            if length > MAX_BODY:
                return self._answer(413, "body too large")
            body = self.rfile.read(length)
            headers = {k.lower(): v for k, v in self.headers.items()}
            event_id = headers.get("webhook-id", "-")
            if secret is None:
                print(f"unverified {event_id} {describe(body)}", file=out, flush=True)
                return self._answer(204)
            try:
                verify(secret, headers, body)
            except Refused as exc:
                print(f"REFUSED {event_id}: {exc}", file=out, flush=True)
                return self._answer(401, str(exc))
            print(f"verified {event_id} {describe(body)}", file=out, flush=True)
            return self._answer(204)

        def _answer(self, status: int, text: str = "") -> None:
            data = text.encode()
            self.send_response(status)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:  # one line per event is printed above
            pass

    return Handler


def make_server(host: str, port: int, secret: str | None,
                out: TextIO = sys.stdout) -> ThreadingHTTPServer:
    return ThreadingHTTPServer((host, port), handler(secret, out))


def main(argv: list[str] | None = None,
         serve: Callable[[ThreadingHTTPServer], None] = ThreadingHTTPServer.serve_forever) -> int:
    p = argparse.ArgumentParser(prog="python -m service.dev.webhook_receiver",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--secret", help="the endpoint's signing secret (whsec_...), shown once when "
                                    "it was created; without it events are printed unverified")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    args = p.parse_args(argv)
    server = make_server(args.host, args.port, args.secret)
    print(f"webhook receiver on http://{args.host}:{server.server_address[1]}/hook "
          f"({'verifying signatures' if args.secret else 'NOT verifying: no --secret'}); "
          "Ctrl-C stops it", flush=True)
    try:
        serve(server)
    except KeyboardInterrupt:
        print("stopped", flush=True)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
