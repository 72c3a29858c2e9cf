"""Writes openapi.yaml (the committed API contract) from the app:
``python -m service.api.openapi`` rewrites it, ``--check`` exits 1 when it is out of date."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from service.api.error_docs import add_error_responses
from service.core.config import Settings

OPENAPI_PATH = Path(__file__).resolve().parents[2] / "openapi.yaml"

def render() -> str:
    """The OpenAPI document of the app as YAML (stable key order as FastAPI emits it)."""
    from fastapi.openapi.utils import get_openapi

    from service.api.app import create_app

    # Settings only feed runtime state; none of it shows in the schema.
    app = create_app(Settings(storage_dir=Path("/tmp/loraplex-openapi"),
                              republish_on_startup=False))
    doc = add_error_responses(get_openapi(title=app.title, version=app.version,
                                          description=app.description, routes=app.routes))
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=100)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        if not OPENAPI_PATH.exists() or OPENAPI_PATH.read_text() != text:
            print("openapi.yaml is out of date: run python -m service.api.openapi", file=sys.stderr)
            return 1
        return 0
    OPENAPI_PATH.write_text(text)
    print(f"wrote {OPENAPI_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
