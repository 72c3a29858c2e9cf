"""Operator commands: ``python -m service.admin migrate`` (Alembic upgrade head),
``create-tenant NAME`` (prints the API key once), ``create-key``, ``revoke-key``,
``set-limit NAME [--max-gpus N|none] [--max-queued-tasks N|none] [--guaranteed-gpus N|none]
[--priority P] [--max-task-priority P|none]``, ``list-tenants``.

Scheduling knobs an operator sets per tenant (service/scheduler/planner.py uses them):
--priority 0-10 weights the tenant's tasks against other tenants' (default 0); --max-task-priority
0-10 is the highest priority its tasks may ask for themselves (none: the configured default,
LORAPLEX_SCHEDULER_DEFAULT_TASK_PRIORITY_CEILING); --guaranteed-gpus is a share lent to others
while idle and reclaimed (by pausing a borrower at a checkpoint) when the tenant needs it;
--max-gpus is a hard cap, borrowing included."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sqlalchemy import select

from service.core.config import get_settings
from service.core.db import make_engine, make_sessionmaker, session_scope
from service.core.errors import ApiError
from service.models import Tenant
from service.tenants import create_api_key, create_tenant, revoke_api_key

ROOT = Path(__file__).resolve().parent.parent
_KEEP = object()  # set-limit: a flag left out leaves that limit as it is


def _limit(value: str) -> int | None:
    """A limit on the command line: a count >= 0, or 'none' for no limit."""
    if value.lower() in ("none", "unlimited"):
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a count or 'none'") from None
    if n < 0:
        raise argparse.ArgumentTypeError("a limit cannot be negative")
    return n


def _priority(value: str) -> int | None:
    """A priority on the command line: 0-10, or 'none' (for a ceiling: the default)."""
    limit = _limit(value)
    if limit is not None and limit > 10:
        raise argparse.ArgumentTypeError("a priority is 0 to 10")
    return limit


def _describe(t: Tenant) -> str:
    return (f"max_gpus={t.max_gpus}\tmax_queued_tasks={t.max_queued_tasks}\t"
            f"guaranteed_gpus={t.guaranteed_gpus}\tpriority={t.priority}\t"
            f"max_task_priority={t.max_task_priority}")


def migrate(database_url: str, revision: str = "head") -> None:
    """Upgrade the database at database_url to revision with the migrations in migrations/."""
    from alembic import command
    from alembic.config import Config

    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    command.upgrade(cfg, revision)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.admin")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("migrate", help="apply database migrations")
    p = sub.add_parser("create-tenant", help="create a tenant and print its API key once")
    p.add_argument("name")
    p.add_argument("--max-gpus", type=int, default=None)
    p.add_argument("--max-queued-tasks", type=_limit, default=None, metavar="N")
    p.add_argument("--if-missing", action="store_true",
                   help="do nothing (exit 0, print nothing) when the tenant exists")
    p = sub.add_parser("create-key", help="print a new API key for an existing tenant")
    p.add_argument("name")
    p = sub.add_parser("revoke-key", help="revoke an API key (read from stdin if '-')")
    p.add_argument("key")
    p = sub.add_parser("set-limit", help="set a tenant's limits (flags left out stay as they are)")
    p.add_argument("name")
    p.add_argument("--max-gpus", type=_limit, default=_KEEP, metavar="N|none",
                   help="GPUs the tenant may hold at once ('none': no limit)")
    p.add_argument("--max-queued-tasks", type=_limit, default=_KEEP, metavar="N|none",
                   help="tasks it may have neither running nor finished; over it POST /v1/tasks "
                        "answers 429 ('none': no limit)")
    p.add_argument("--guaranteed-gpus", type=_limit, default=_KEEP, metavar="N|none",
                   help="GPUs guaranteed to the tenant: lent to others while it does not use "
                        "them, reclaimed by preemption when it does ('none': no guarantee)")
    p.add_argument("--priority", type=_priority, default=_KEEP, metavar="P",
                   help="the tenant's scheduling priority, 0-10 (default 0)")
    p.add_argument("--max-task-priority", type=_priority, default=_KEEP, metavar="P|none",
                   help="highest priority (0-10) a task of the tenant may ask for; above it "
                        "POST /v1/tasks answers 422 ('none': the service default)")
    sub.add_parser("list-tenants")
    args = parser.parse_args(argv)
    settings = get_settings()
    if args.cmd == "migrate":
        migrate(settings.database_url)
        print("migrations: at head")
        return 0
    factory = make_sessionmaker(make_engine(settings.database_url))
    with session_scope(factory) as session:
        if args.cmd == "create-tenant":
            try:
                tenant, key = create_tenant(session, args.name, args.max_gpus)
            except ApiError as exc:
                if args.if_missing and exc.code == "tenant_exists":
                    return 0
                print(f"error: {exc.message}", file=sys.stderr)
                return 1
            tenant.max_queued_tasks = args.max_queued_tasks
            print(f"tenant: {tenant.id} ({tenant.name})", file=sys.stderr)
            print(key)
        elif args.cmd == "create-key":
            tenant = session.scalar(select(Tenant).where(Tenant.name == args.name))
            if tenant is None:
                print(f"error: no tenant {args.name!r}", file=sys.stderr)
                return 1
            print(create_api_key(session, tenant))
        elif args.cmd == "revoke-key":
            key = sys.stdin.readline().strip() if args.key == "-" else args.key
            if not revoke_api_key(session, key):
                print("error: no such key", file=sys.stderr)
                return 1
            print("revoked", file=sys.stderr)
        elif args.cmd == "set-limit":
            tenant = session.scalar(select(Tenant).where(Tenant.name == args.name))
            if tenant is None:
                print(f"error: no tenant {args.name!r}", file=sys.stderr)
                return 1
            knobs = ("max_gpus", "max_queued_tasks", "guaranteed_gpus", "priority",
                     "max_task_priority")
            given = {k: getattr(args, k) for k in knobs if getattr(args, k) is not _KEEP}
            if not given:
                print("error: give at least one of --max-gpus, --max-queued-tasks, "
                      "--guaranteed-gpus, --priority, --max-task-priority", file=sys.stderr)
                return 2
            if given.get("priority", 0) is None:
                print("error: --priority is 0 to 10", file=sys.stderr)
                return 2
            for k, v in given.items():
                setattr(tenant, k, v)
            print(f"{tenant.name}: {_describe(tenant)}", file=sys.stderr)
        else:
            for t in session.scalars(select(Tenant).order_by(Tenant.created_at)):
                print(f"{t.id}\t{t.name}\t{_describe(t)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
