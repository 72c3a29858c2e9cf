"""Starts a private PostgreSQL and Redis in a directory, for the dev stack and the tests, and writes
the dev stack's settings file. Used by scripts/loraplex-up.sh and tests/integration."""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DB_USER = "loraplex"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_bin(name: str) -> str:
    """Path of a PostgreSQL server binary (Debian keeps them off PATH), newest version first."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    if found:
        return found[0]
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"PostgreSQL binary {name!r} not found; run scripts/install.sh")
    return path


def _as_pg_user(cmd: list[str]) -> list[str]:
    # postgres refuses to run as root: drop to the postgres system user.
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


def _chown_for_pg(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


def _wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


@dataclass
class Postgres:
    """A private cluster in ``data_dir`` listening on 127.0.0.1:port (trust auth, local only)."""

    root: Path
    port: int

    @property
    def data_dir(self) -> Path:
        return self.root / "pgdata"

    def url(self, dbname: str = "loraplex") -> str:
        return f"postgresql+psycopg://{DB_USER}@127.0.0.1:{self.port}/{dbname}"

    def is_running(self) -> bool:
        if not (self.data_dir / "postmaster.pid").exists():
            return False
        rc = subprocess.run(_as_pg_user([pg_bin("pg_ctl"), "status", "-D", str(self.data_dir)]),
                            capture_output=True).returncode
        return rc == 0

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        _chown_for_pg(self.root)
        if not (self.data_dir / "PG_VERSION").exists():
            subprocess.run(_as_pg_user([pg_bin("initdb"), "-D", str(self.data_dir), "-U", DB_USER,
                                        "--auth=trust", "-E", "UTF8", "--no-sync"]),
                           check=True, capture_output=True)
        if self.is_running():
            return
        log = self.root / "postgres.log"
        opts = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        subprocess.run(_as_pg_user([pg_bin("pg_ctl"), "start", "-w", "-t", "60", "-D",
                                    str(self.data_dir), "-l", str(log), "-o", opts]),
                       check=True, capture_output=True)
        _wait_port(self.port, 30)

    def create_database(self, name: str, template: str | None = None) -> None:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user={DB_USER} dbname=postgres",
                             autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname=%s", (name,)).fetchone()
            if not exists:
                tmpl = f' TEMPLATE "{template}"' if template else ""
                conn.execute(f'CREATE DATABASE "{name}"{tmpl}')

    def stop(self) -> None:
        subprocess.run(_as_pg_user([pg_bin("pg_ctl"), "stop", "-m", "fast", "-D",
                                    str(self.data_dir)]), capture_output=True)


@dataclass
class Redis:
    """A private redis-server with its data and log under ``root``."""

    root: Path
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def is_running(self) -> bool:
        try:
            import redis

            return bool(redis.Redis.from_url(self.url, socket_timeout=1).ping())
        except Exception:
            return False

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.is_running():
            return
        subprocess.run([shutil.which("redis-server") or "redis-server", "--port", str(self.port),
                        "--bind", "127.0.0.1", "--dir", str(self.root), "--daemonize", "yes",
                        "--pidfile", str(self.root / "redis.pid"),
                        "--logfile", str(self.root / "redis.log"), "--save", "", "--appendonly",
                        "yes"], check=True, capture_output=True)
        _wait_port(self.port, 30)

    def stop(self) -> None:
        pidfile = self.root / "redis.pid"
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text().strip()), 15)
            except (ProcessLookupError, ValueError):
                pass


# The settings of the stack that `env` writes, taken from the environment loraplex-up.sh set.
STACK_SETTINGS = ("LORAPLEX_DATABASE_URL", "LORAPLEX_REDIS_URL", "LORAPLEX_WORKER_TOKEN",
                  "LORAPLEX_STORAGE_DIR", "LORAPLEX_MODELS_FILE", "LORAPLEX_WANDB_DIR")
# Development settings of the local stack only (deploy/ and docker-compose.yml keep them off):
# webhook receivers and MLflow servers on loopback or private addresses are allowed, so the
# README's tour can point them at a receiver on this machine. Each keeps a value the caller set.
DEV_SETTINGS = {
    "LORAPLEX_WEBHOOK_ALLOW_PRIVATE": "webhooks may be delivered to loopback and private addresses",
    "LORAPLEX_TRACKING_ALLOW_PRIVATE": "MLflow servers may be on loopback and private addresses",
}


def stack_env(environ: dict[str, str], root: Path, api_url: str) -> dict[str, str]:
    """The dev stack's settings: what the environment holds of STACK_SETTINGS (the W&B folder
    under `root` when unset), the development settings (true unless set), the API's URL."""
    env = {name: environ[name] for name in STACK_SETTINGS if environ.get(name)}
    env.setdefault("LORAPLEX_WANDB_DIR", str(root.resolve() / "wandb"))
    env.update({name: environ.get(name) or "true" for name in DEV_SETTINGS})
    env["LORAPLEX_API_URL"] = api_url
    return env


def write_env(path: Path, env: dict[str, str]) -> list[str]:
    """Write `env` as a file a shell sources; the development settings that are on, logged."""
    lines = ["# The local stack's settings, written by scripts/loraplex-up.sh: `source` this file",
             "# before operator commands. *_ALLOW_PRIVATE are development settings of this stack",
             "# (deploy/ keeps them false): export them as false before loraplex-up.sh to refuse",
             "# loopback and private webhook receivers and MLflow servers."]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    path.write_text("\n".join(lines) + "\n")
    on = [name for name in DEV_SETTINGS if env.get(name, "").lower() in ("1", "true", "yes", "on")]
    for name in on:
        print(f"loraplex-up: development setting {name}=true: {DEV_SETTINGS[name]} (the local "
              f"stack only; {path.name} records it)", file=sys.stderr)
    return on


def main(argv: list[str] | None = None) -> int:
    """``up DIR``: start (or reuse) Postgres and Redis under DIR and print their URLs as env lines;
    ``down DIR``: stop them; ``env DIR``: write DIR/loraplex.env (stack_env, write_env)."""
    p = argparse.ArgumentParser(prog="python -m service.core.localstack")
    p.add_argument("action", choices=["up", "down", "env"])
    p.add_argument("dir", type=Path)
    p.add_argument("--api-url", default="http://127.0.0.1:8000")
    p.add_argument("--pg-port", type=int, default=int(os.environ.get("LORAPLEX_PG_PORT", 55432)))
    p.add_argument("--redis-port", type=int,
                   default=int(os.environ.get("LORAPLEX_REDIS_PORT", 56379)))
    args = p.parse_args(argv)
    root = args.dir.resolve()
    if args.action == "env":
        write_env(root / "loraplex.env", stack_env(dict(os.environ), root, args.api_url))
        return 0
    pg = Postgres(root / "postgres", args.pg_port)
    rd = Redis(root / "redis", args.redis_port)
    if args.action == "down":
        pg.stop()
        rd.stop()
        return 0
    pg.start()
    pg.create_database("loraplex")
    rd.start()
    print(f"LORAPLEX_DATABASE_URL={pg.url()}")
    print(f"LORAPLEX_REDIS_URL={rd.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
