"""A task that joins a warm node, and samples asked on demand there (issue 41: first step at most
3 s after the placement is claimed; issue 44: an on-demand request that joins a warm host returns
in at most 15 s), through the real shared executor process (`python -m worker.host`, started as
the daemon starts it) and its control channel (inbox requests, spool, status.json).

On a Llama-3.1-8B-shaped model with random bf16 weights and `--layers` layers:
1. task A (8 jobs) is attached to a new host process: the node's cold start (process, load, first
   step), then A trains to its end and the host lingers warm;
2. task B (8 other jobs, same model) is attached to the lingering host: the time from the attach
   request (what the daemon sends once it has claimed the placement and fetched its files) to
   B's first training point in B's spool, and B's own timings report (its wall from its join);
3. samples on demand: a request dir as the daemon writes it (work.json, 3 of B's adapters), sent
   as {"op": "sample"} to the lingering host: the time until its result.json (8 prompts, 3 adapters
   + base, 128 new tokens, greedy).
The daemon's own parts (claiming through the service, fetching files, its poll interval) are not
in these times: the table says so.

    python bench/warm_host.py [--layers 32] [--out FILE.md] [--json FILE]
    python bench/warm_host.py --smoke          # CPU, toy sizes: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import executor_task as et  # noqa: E402
import task_e2e_data as te  # noqa: E402

from contract.protocol import (  # noqa: E402
    JobHyperparameters,
    JobSpec,
    PlacementSpec,
    SampleSettings,
    TaskSettings,
)
from contract.sample_requests import SampleAdapter, SampleWork  # noqa: E402
from worker import host as shared  # noqa: E402
from worker.processes import CUBLAS_WORKSPACE, ForkedProcess  # noqa: E402
from worker.sampler import ADAPTERS_NAME, RESULT_NAME, WORK_NAME  # noqa: E402
from worker.spool import read_complete_lines  # noqa: E402
from worker.zygote import Zygote  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GRID = [(16, 1, 1e-4), (32, 2, 3e-4), (64, 4, 1e-3), (16, 2, 2e-4), (32, 4, 5e-4), (64, 1, 1e-3),
        (16, 4, 1e-4), (32, 1, 3e-4)]


def placement(root: Path, name: str, model: Path, train: Path, max_seq_len: int, layers_note: str,
              samples: bool) -> Path:
    """A placement folder as the daemon leaves it after the claim: spec.json and data/."""
    directory = root / "placements" / name
    shutil.rmtree(directory, ignore_errors=True)
    (directory / "data").mkdir(parents=True)
    shutil.copyfile(train, directory / "data" / "train.jsonl")
    jobs = [JobSpec(job_id=f"{name}_j{i}", index=i, state="pending",
                    hyperparameters=JobHyperparameters(learning_rate=lr, lora_rank=r, lora_alpha=2 * r, batch_size=b))
            for i, (r, b, lr) in enumerate(GRID)]
    spec = PlacementSpec(
        task_id=f"task_{name}", placement_id=name, attempt=1, node_id="bench", gpu_indices=[0], method="sft",
        base_model=f"llama-8b-shape-{layers_note}", base_model_path=str(model), training_file_id="f",
        training_file_url="/f", training_file_format="prompt_completion",
        settings=TaskSettings(validation_split=0.1, epochs=1, max_seq_len=max_seq_len, seed=7,
                              samples=SampleSettings(enabled=samples)),
        jobs=jobs)
    (directory / "spec.json").write_text(spec.model_dump_json())
    return directory


def records(directory: Path) -> list[dict]:
    path = directory / "spool.jsonl"
    if not path.exists():
        return []
    return [json.loads(t) for _, _, t in read_complete_lines(path, 0)]


def wait(predicate, what: str, timeout: float, poll: float = 0.01):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out waiting for {what}")


def first_point(directory: Path) -> bool:
    return any(r["type"] == "metric" and r["point"]["split"] == "train" for r in records(directory))


def finished(directory: Path) -> dict | None:
    recs = records(directory)
    return recs[-1] if recs and recs[-1]["type"] in ("finished", "failed") else None


def lingering(host_dir: Path) -> bool:
    status = shared.read_status(host_dir)
    return status.get("state") == "serving" and not status.get("hosted")


def timings(directory: Path) -> dict | None:
    found = [r["report"] for r in records(directory) if r["type"] == "timings"]
    return found[-1] if found else None


def sample_dir(root: Path, b: Path, model: Path, new: int) -> Path:
    """A sample request as the daemon writes it: work.json and 3 of B's adapters."""
    directory = root / "samples" / "req1"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    adapters = [r for r in records(b) if r["type"] == "artifact" and r["meta"]["kind"] == "adapter"][:3]
    for r in adapters:
        shutil.copytree(b / r["dir"], directory / ADAPTERS_NAME / r["meta"]["job_id"])
    prompts = [" ".join(f"w{(i * 37 + k) % te.K}" for k in range(60)) for i in range(8)]
    work = SampleWork(request_id="req1", lease_token="t", lease_s=60, task_id="task_b", attempt=1,
                      base_model="bench", base_model_path=str(model), prompts=prompts,
                      adapters=[SampleAdapter(job_id=r["meta"]["job_id"], files=[]) for r in adapters],
                      include_base=True, max_new_tokens=new, temperature=0.0, top_p=1.0, seed=0)
    (directory / WORK_NAME).write_text(work.model_dump_json())
    return directory


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--n-train", type=int, default=240)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--work", default="/tmp/warm_host")
    ap.add_argument("--reuse", action="store_true", help="keep the work directory's model")
    ap.add_argument("--deadline-s", type=float, default=480)
    ap.add_argument("--out", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--spare", action="store_true",
                    help="start the host as a node's spare (worker.host --spare): warmed up before task A's "
                         "attach, which then starts the clock (issue 41: a GPU node keeps one per free GPU)")
    ap.add_argument("--zygote", action="store_true",
                    help="fork the host from a node's zygote (worker.zygote: the executor's imports done, no "
                         "CUDA), as the daemon does on a GPU node; the clock starts at the fork request")
    args = ap.parse_args()
    # as worker.processes.spawn gives every GPU process of a node (the repeatable decode's samples)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if args.smoke:
        te.SMOKE["on"] = True
        args.layers, args.n_train, args.new = 2, 24, 4
    end_by = time.monotonic() + args.deadline_s
    root = Path(args.work)
    model = root / "model"
    if not (args.reuse and (model / "config.json").exists()):
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        te.log("building the model")
        model = te.large_model(model, args.layers, te.make_tokenizer())
    train = et.write_data(root / "train.jsonl", args.n_train, 1)
    max_seq_len = 128 if args.smoke else 1024
    # A ends with the product's end-of-task samples (8 prompts, top 3 + base, 128 new tokens)
    a = placement(root, "pl_a", model, train, max_seq_len, str(args.layers), samples=True)
    b = placement(root, "pl_b", model, train, max_seq_len, str(args.layers), samples=False)
    host_dir = root / "hosts" / "h1"
    shutil.rmtree(host_dir, ignore_errors=True)
    host_dir.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "0",
           "LORAPLEX_SLOTS": "0", "TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR") or str(root / "triton")}
    res: dict = {"args": vars(args)}
    if not args.spare:  # the daemon writes the first request before it starts a host
        shared.send(host_dir, {"op": "attach", "placement_id": a.name, "placement_dir": str(a)})
    left = lambda: max(1.0, end_by - time.monotonic())  # noqa: E731
    host_args = ["--host-dir", str(host_dir), "--linger-s", "600", "--lease-timeout-s", "0",
                 *(["--spare"] if args.spare else [])]
    zygote = None
    if args.zygote:  # started as the daemon starts it: the node's environment, no GPU of its own
        t0 = time.monotonic()
        zygote = Zygote({**env, "CUDA_VISIBLE_DEVICES": "", "LORAPLEX_SLOTS": ""}, root, root / "zygote.log")
        if not zygote.ready(left()):
            raise SystemExit("the zygote did not get ready: " + (root / "zygote.log").read_text()[-2000:])
        res["zygote_ready_s"], res["zygote_imports_s"] = time.monotonic() - t0, zygote.info["imports_s"]
        te.log(f"zygote: ready {res['zygote_ready_s']:.1f} s after its start (imports {res['zygote_imports_s']:.1f} s)")
    t_start = time.monotonic()
    log = (host_dir / "host.log").open("ab")
    if zygote is not None:
        pid = zygote.spawn("worker.host", host_args, env, host_dir, host_dir / "host.log")
        if pid is None:
            raise SystemExit("the zygote refused the host")
        proc = ForkedProcess(pid, host_dir)
        res["fork_s"] = time.monotonic() - t_start
    else:
        proc = subprocess.Popen([sys.executable, "-m", "worker.host", *host_args], env=env, cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if args.spare:
            status = wait(lambda: (s := shared.read_status(host_dir)).get("warm_s") is not None and s,
                          "the spare to warm up", left())
            res["spare_ready_s"], res["spare_warm_s"] = time.monotonic() - t_start, status["warm_s"]
            te.log(f"spare: warm {res['spare_ready_s']:.1f} s after its start (warm-up {status['warm_s']:.1f} s)")
            shared.send(host_dir, {"op": "attach", "placement_id": a.name, "placement_dir": str(a)})
            t_start = time.monotonic()
        wait(lambda: first_point(a), "A's first step", left())
        res["cold_first_step_s"] = time.monotonic() - t_start
        te.log(f"A: first step {res['cold_first_step_s']:.1f} s after "
               + ("its attach to the spare" if args.spare else "the host process started"
                  + (" (forked by the zygote)" if zygote else "")))
        wait(lambda: finished(a), "A's end", left(), poll=0.2)
        res["a_wall_s"] = time.monotonic() - t_start
        res["a_timings"] = timings(a)
        wait(lambda: lingering(host_dir), "the host to linger", left())
        t0 = time.monotonic()
        shared.send(host_dir, {"op": "attach", "placement_id": b.name, "placement_dir": str(b)})
        wait(lambda: first_point(b), "B's first step", left())
        res["warm_first_step_s"] = time.monotonic() - t0
        te.log(f"B: first step {res['warm_first_step_s']:.2f} s after the attach request")
        wait(lambda: finished(b), "B's end", left(), poll=0.2)
        res["b_wall_s"] = time.monotonic() - t0
        res["b_timings"] = timings(b)
        res["b_end"] = finished(b)["type"]
        wait(lambda: lingering(host_dir), "the host to linger again", left())
        req = sample_dir(root, b, model, args.new)
        t0 = time.monotonic()
        shared.send(host_dir, {"op": "sample", "dir": str(req)})
        result = wait(lambda: (req / RESULT_NAME).exists() and json.loads((req / RESULT_NAME).read_text()),
                      "the sample result", left())
        res["sample_s"] = time.monotonic() - t0
        samples = result.get("samples") or []
        res["sample_result"] = {"rows": len(samples), "refused": result.get("refused"), "error": result.get("error"),
                                "configurations": len({str(s.get("job_id")) for s in samples}),
                                "new_tokens": sum(int(s.get("tokens") or 0) for s in samples)}
        te.log(f"samples on demand: {res['sample_s']:.2f} s, {res['sample_result']}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        if zygote is not None:
            zygote.close()
    host_log = (host_dir / "host.log").read_text(errors="replace")
    res["host_log_tail"] = host_log[-3000:]
    # each task's memory trace (trainer.memory_plan: cells, recompute, resident, peak, predicted MB)
    res["memory_traces"] = [json.loads(line.split("steps=", 1)[1]) for line in host_log.splitlines()
                            if "memory trace steps=" in line]
    # the executor's load by part (trainer.executor: device, model, data, engine, memory, open) and
    # the fused blocks' probes
    res["load_parts"] = [json.loads(line.split("seconds=", 1)[1]) for line in host_log.splitlines()
                         if "load parts seconds=" in line]
    res["fused_blocks_log"] = [line.split("fused blocks: ", 1)[1] for line in host_log.splitlines()
                               if "fused blocks: " in line]
    dev = "cpu"
    try:
        import torch

        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        pass
    bt = res.get("b_timings") or {}
    text = "\n".join(line for line in [
        f"# A task joining a warm host, samples on demand there ({dev})", "",
        f"Llama-3.1-8B shape, random bf16 weights, {args.layers} layers; tasks of 8 jobs (ranks 16/32/64, batch "
        f"1/2/4), {args.n_train} prompt/completion samples, 1 epoch, max_seq_len {max_seq_len}; the real shared "
        "executor process (`python -m worker.host`) driven through its inbox as the daemon drives it. Times start "
        "at the daemon's request (the claim through the service, the file fetches and the daemon's poll are not "
        "in them). `python bench/warm_host.py " + " ".join(sys.argv[1:]) + "`.", "",
        "| measure | seconds |", "|---|---|",
        (f"| spare: process start -> warmed up (its warm-up {res.get('spare_warm_s', float('nan')):.2f}) | "
         f"{res.get('spare_ready_s', float('nan')):.2f} |") if args.spare else None,
        (f"| zygote: process start -> its imports done (imports {res.get('zygote_imports_s', float('nan')):.2f}) | "
         f"{res.get('zygote_ready_s', float('nan')):.2f} |") if args.zygote else None,
        ("| cold model on a spare: attach request -> task A's first training point | " if args.spare else
         "| cold: host process forked by the zygote -> task A's first training point | " if args.zygote else
         "| cold: host process start -> task A's first training point | ")
        + f"{res.get('cold_first_step_s', float('nan')):.2f} |",
        f"| cold: task A's own first step (its timings, from the executor's start) | "
        f"{(res.get('a_timings') or {}).get('first_step_s', float('nan')):.2f} |",
        f"| cold: task A's end-of-task samples (its timings: 3 adapters + base, 8 prompts, 128 new tokens) | "
        f"{((res.get('a_timings') or {}).get('phases') or {}).get('samples', float('nan')):.2f} |",
        f"| warm: attach request -> task B's first training point | {res.get('warm_first_step_s', float('nan')):.2f} |",
        f"| warm: task B's own first step (its timings, from its join) | {bt.get('first_step_s', float('nan')):.2f} |",
        f"| warm: task B's own wall (its timings) / its training | {bt.get('wall_s', float('nan')):.1f} / "
        f"{(bt.get('phases') or {}).get('train', float('nan')):.1f} |",
        f"| samples on demand on the warm host: request -> result ({res.get('sample_result')}) | "
        f"{res.get('sample_s', float('nan')):.2f} |", "",
        "Task B's timings: " + json.dumps(bt, default=str)] if line is not None) + "\n"
    te.emit(text, res, args)


if __name__ == "__main__":
    main()
