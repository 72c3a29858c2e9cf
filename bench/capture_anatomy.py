"""Where a step graph's capture spends its time (issues 40, 41): a capture step costs 0.2-0.4 s over a
replay at 32 layers of the Llama-3.1-8B shape (search (a) captured 10 keys, the 60-step task 6, the
200-step task 9), and an eager step about as much.

Builds the engine as bench/host_profile.py does (`--layers` layers, random bf16 weights, varlen
attention, 2 jobs: r16 b1 + r64 b4, samples of ~`--tokens` tokens), then:
  1. `--steps` steps with the step graphs, each synced and timed, with what the graphs did in it
     (capture, replay, covered, eager run): the capture's and the eager run's excess over a replay;
  2. fresh step graphs (nothing captured) and `--profiled` steps under cProfile: host seconds by
     function (the Tuned kernels' launches, Triton's JIT launch, the capture's begin and end, the
     allocator's empty_cache, autograd), per call where it matters;
  3. the same under torch.profiler (CPU activity): the CUDA runtime calls of the capture steps
     (cudaGraphInstantiate, cudaMalloc, cudaFree, synchronizations) by host time.
Prints torch.cuda.graph.__enter__'s source (what a capture does before it begins on this torch).

    python bench/capture_anatomy.py [--layers 32] [--tokens 400] [--steps 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_profile import build  # noqa: E402

from trainer.step_graphs import StepGraphs  # noqa: E402


def timed_steps(eng, n: int) -> list[dict]:  # noqa: ANN001
    """n synced steps: wall, tokens and what the graphs did in each."""
    rows = []
    for _ in range(n):
        before = dict(eng.step_graphs.stats())
        t0 = time.perf_counter()
        rep = eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        after = eng.step_graphs.stats()
        did = "+".join(k for k in ("captures", "eager_runs", "covered", "replays") if after[k] > before.get(k, 0))
        rows.append({"wall_s": round(wall, 4), "tokens": rep.tokens, "did": did or "none"})
    return rows


def cprofile_table(prof: cProfile.Profile, sort: str, limit: int) -> str:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).strip_dirs().sort_stats(sort).print_stats(limit)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profiled", type=int, default=4, help="steps under cProfile after the graphs are reset")
    ap.add_argument("--out", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    eng = build(args.layers, False, args.tokens)
    eng.set_recompute(False)
    eng.step_graphs = StepGraphs(eng)
    steps = timed_steps(eng, args.steps)
    replays = sorted(s["wall_s"] for s in steps if s["did"] in ("replays", "covered+replays"))
    replay = replays[len(replays) // 2] if replays else float("nan")
    excess = {k: [round(s["wall_s"] - replay, 3) for s in steps if k in s["did"]] for k in ("captures", "eager_runs")}
    # 2. fresh graphs under cProfile: the first step runs eagerly, the next ones capture
    eng.step_graphs = StepGraphs(eng)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof_steps = []
    for _ in range(args.profiled):
        before = dict(eng.step_graphs.stats())
        t0 = time.perf_counter()
        prof.enable()
        rep = eng.step()
        torch.cuda.synchronize()
        prof.disable()
        after = eng.step_graphs.stats()
        prof_steps.append({"wall_s": round(time.perf_counter() - t0, 4), "tokens": rep.tokens,
                           "did": "+".join(k for k in ("captures", "eager_runs", "covered", "replays")
                                           if after[k] > before.get(k, 0))})
    by_tottime = cprofile_table(prof, "tottime", 40)
    by_cumtime = cprofile_table(prof, "cumulative", 60)
    # 3. torch.profiler's CPU view of two more captures (fresh graphs again)
    from torch.profiler import ProfilerActivity, profile

    eng.step_graphs = StepGraphs(eng)
    eng.step()  # the eager first step of the fresh graphs
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as tprof:
        for _ in range(2):
            eng.step()
        torch.cuda.synchronize()
    runtime = tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    enter = inspect.getsource(torch.cuda.graph.__enter__)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
           "steps": steps, "replay_median_s": replay, "excess_s": excess, "profiled_steps": prof_steps}
    text = "\n".join([
        f"# A step graph's capture, in parts ({res['device']}, torch {torch.__version__}, {args.layers} layers of the "
        f"Llama-3.1-8B shape, 2 jobs, ~{args.tokens} tokens a sample, no recompute)", "",
        "`python bench/capture_anatomy.py " + " ".join(sys.argv[1:]) + "`", "",
        f"Replay median {replay:.4f} s; capture excess over it {excess['captures']}; eager excess {excess['eager_runs']}.",
        "", "Steps: " + json.dumps(steps), "", "cProfiled steps (fresh graphs): " + json.dumps(prof_steps), "",
        "## cProfile by own time", "```", by_tottime[:12000], "```", "",
        "## cProfile by cumulative time", "```", by_cumtime[:16000], "```", "",
        "## torch.profiler (CPU) of two capture steps", "```", runtime[:9000], "```", "",
        "## torch.cuda.graph.__enter__", "```python", enter, "```"]) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
