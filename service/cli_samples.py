"""`loraplex samples TASK`: the completions the task ended with, or, with --prompt, samples on
demand: your prompts answered by the task's adapters (--job, or the --top-k by validation loss)
and its base model, posted and waited for (the request's state as a merged model's)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Console

from service.cli_tables import print_samples
from service.sample_requests.states import SAMPLE_REQUEST_LIVE, SampleRequestState


class SamplesError(Exception):
    """A request that ended without completions (its state and error)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("task_id")
    p.add_argument("--prompt", action="append", dest="prompts", metavar="TEXT",
                   help="Ask for samples on demand with this prompt (repeatable; up to 32).")
    p.add_argument("--job", action="append", dest="job_ids", metavar="JOB_ID",
                   help="A job whose adapter answers (repeatable); default: the top 3.")
    p.add_argument("--top-k", type=int, help="The k jobs of the best validation loss.")
    p.add_argument("--no-base", action="store_true", help="Leave the base model out.")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy.")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interval", type=float, default=1.0, help="Seconds between polls.")


def request_body(args: argparse.Namespace) -> dict:
    body: dict[str, Any] = {"prompts": args.prompts, "include_base": not args.no_base,
                            "max_new_tokens": args.max_new_tokens,
                            "temperature": args.temperature, "top_p": args.top_p,
                            "seed": args.seed}
    if args.job_ids:
        body["job_ids"] = args.job_ids
    if args.top_k is not None:
        body["top_k"] = args.top_k
    return body


def request_samples(api: Any, args: argparse.Namespace, sleep: Any = time.sleep) -> dict:
    """POST the request and poll it until it ended; the succeeded request (SamplesError else)."""
    req = api.json("POST", f"/v1/tasks/{args.task_id}/samples", json=request_body(args))
    while req["state"] in SAMPLE_REQUEST_LIVE:
        sleep(args.interval)
        req = api.json("GET", f"/v1/tasks/{args.task_id}/samples/{req['id']}")
    if req["state"] != SampleRequestState.SUCCEEDED:
        raise SamplesError(f"sample request {req['id']} {req['state']}: {req.get('error')}")
    return req


def run(api: Any, args: argparse.Namespace, console: Console, show: Any) -> None:
    if not args.prompts:
        page = api.json("GET", f"/v1/tasks/{args.task_id}/samples")
        (show if args.json else lambda p: print_samples(console, p))(page)
        return
    req = request_samples(api, args)
    (show if args.json else lambda r: print_samples(console, r))(req)
