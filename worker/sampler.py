"""Samples on demand, the node's side of the decode (issue 44): ``python -m worker.sampler --dir
DIR`` loads the backbone from the local model directory, attaches the task's stored adapters and
answers the request's prompts with trainer.sampling.generate, one batch for every adapter and the
base model. A lingering shared executor (worker.host) answers with its own engine instead
(`answer`). DIR holds work.json (contract.sample_requests.SampleWork) and adapters/<job_id>/;
result.json is written atomically: {"samples": [...]} or {"error": message} (a message fit for
the tenant). The trainer is imported lazily: the daemon imports this module without torch."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from contract.protocol import tenant_safe
from contract.sample_requests import SampleWork

log = logging.getLogger("loraplex.worker.sampler")
WORK_NAME = "work.json"
RESULT_NAME = "result.json"
ADAPTERS_NAME = "adapters"


class SampleError(Exception):
    """A request that cannot be answered, with a message fit for the tenant."""


def read_work(directory: Path) -> SampleWork:
    return SampleWork.model_validate_json((directory / WORK_NAME).read_text())


def write_result(directory: Path, result: dict) -> None:
    tmp = directory / f".{RESULT_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, directory / RESULT_NAME)


def read_result(directory: Path) -> dict | None:
    try:
        data = json.loads((directory / RESULT_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def adapter_config(directory: Path, job_id: str) -> dict:
    try:
        cfg = json.loads((directory / ADAPTERS_NAME / job_id / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise SampleError(f"the adapter of job {job_id!r} has no readable adapter_config.json") from exc
    if not isinstance(cfg, dict) or not isinstance(cfg.get("r"), int):
        raise SampleError(f"the adapter of job {job_id!r} names no rank")
    return cfg


def targets_of(directory: Path, work: SampleWork) -> list[str] | None:
    """The linears the adapters adapt (their union); None: the family's default ones."""
    names: set[str] = set()
    for a in work.adapters:
        names.update(adapter_config(directory, a.job_id).get("target_modules") or ())
    return sorted(names) or None


def answer(engine: Any, tokenizer: Any, work: SampleWork, directory: Path) -> list[dict]:
    """Every prompt answered by the base model (when asked) and each adapter, rows of one decode
    batch on `engine` (a trainer.engine.MultiLoraEngine); the adapters leave it afterwards."""
    from trainer.jobs import TrainJob
    from trainer.sampling import generate
    from trainer.task_samples import inline_prompt_ids, shown

    prompts = [inline_prompt_ids(tokenizer, text) for text in work.prompts]
    attached: list[str] = []
    try:
        for a in work.adapters:
            cfg = adapter_config(directory, a.job_id)
            name = f"__ondemand__{work.request_id}__{a.job_id}"
            try:
                engine.attach(TrainJob(name, lora_rank=int(cfg["r"]),
                                       lora_alpha=float(cfg.get("lora_alpha") or cfg["r"]),
                                       use_rslora=bool(cfg.get("use_rslora")), max_steps=1,
                                       init_adapter=str(directory / ADAPTERS_NAME / a.job_id)))
            except ValueError as exc:  # a module or shape this backbone does not have
                raise SampleError(f"the adapter of job {a.job_id!r} does not fit the base model "
                                  f"({tenant_safe(str(exc), 200)})") from exc
            attached.append(name)
        columns: list[str | None] = ([None] if work.include_base else []) + attached
        rows = [(p, c) for p in range(len(prompts)) for c in columns]
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
        new = generate(engine, [prompts[p] for p, _ in rows], [c for _, c in rows],
                       max_new_tokens=work.max_new_tokens, temperature=work.temperature,
                       top_p=work.top_p, seed=work.seed, eos_token_id=eos, pad_id=pad)
    finally:
        for name in attached:
            engine.detach(name)
    return [{"prompt": shown(work.prompts[p]),
             "job_id": None if c is None else c.rsplit("__", 1)[1],
             "completion": tokenizer.decode(tokens, skip_special_tokens=True), "tokens": len(tokens)}
            for (p, c), tokens in zip(rows, new, strict=True)]


def load_engine(model_dir: str, targets: list[str] | None) -> tuple[Any, Any]:
    """A fresh backbone from the local model directory, in the executor's dtype, as an engine
    with no job: (engine, tokenizer)."""
    import torch
    from transformers import AutoTokenizer

    from kernels.shipped_cache import seed as seed_triton_cache
    from trainer.engine import MultiLoraEngine
    from trainer.strategy import OneGpu

    if not Path(model_dir).is_dir():
        raise SampleError("the base model's weights are not available on this node")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        seed_triton_cache()  # the kernels shipped for this GPU kind
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = OneGpu().load_model(model_dir, device, dtype)  # the executor's load (parallel, staged on a GPU)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    engine = MultiLoraEngine(model, [], pad, targets, gradient_checkpointing=False)
    return engine, tokenizer


def run(directory: Path, engine: Any = None, tokenizer: Any = None) -> dict:
    """Answer the request in `directory` (on `engine`, or a freshly loaded one) and write its
    result.json; the result."""
    try:
        work = read_work(directory)
        if engine is None:
            engine, tokenizer = load_engine(work.base_model_path, targets_of(directory, work))
        result: dict = {"samples": answer(engine, tokenizer, work, directory)}
    except SampleError as exc:
        result = {"error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - logged in full; the tenant sees its kind only
        log.exception("sampling failed dir=%s", directory)
        result = {"error": f"the sampling failed ({type(exc).__name__}: {tenant_safe(str(exc), 200)})"}
    write_result(directory, result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.sampler", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("LORAPLEX_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    result = run(args.dir.resolve())
    log.info("sampling done dir=%s rows=%d error=%s", args.dir, len(result.get("samples") or ()),
             result.get("error"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
