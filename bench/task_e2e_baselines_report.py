"""The table of bench/task_e2e_baselines.py: each arm's time over the whole grid extrapolated from
its measured twins, merged from the JSON files of one or several calls, with the quality, step-0
and method sections."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines import PEAK_FLOPS, config_matmul_params  # noqa: E402
from engine_step import llama8b_config  # noqa: E402
from task_e2e_baselines_setup import SMALL_SHAPE  # noqa: E402


# ----------------------------------------------------------------------------- extrapolation
def _pair(arm: dict, bs: int, rank: int) -> tuple[dict, str | None]:
    """The measured twin of (bs, rank): itself, else the same batch size's nearest rank."""
    pairs = arm["pairs"]
    if f"{bs},{rank}" in pairs:
        return pairs[f"{bs},{rank}"], None
    same = [k for k in pairs if int(k.split(",")[0]) == bs]
    if not same:
        raise KeyError(f"batch size {bs} was not measured")
    k = min(same, key=lambda k: abs(math.log(int(k.split(",")[1]) / rank)))
    return pairs[k], k


def _eval_time(arm: dict, size: int) -> float:
    table = {int(k): statistics.median(v) for k, v in arm["eval_by_size"].items()}
    if size in table:
        return table[size]
    near = min(table, key=lambda k: abs(k - size))
    return table[near] * size / near  # linear in the samples evaluated


def estimate(meta: list[dict], arm: dict, kind: str, keep: list[str] | None = None) -> dict:
    """An arm's time over the whole grid from its measured twins (see the module docstring).
    kind c1 / c2: every configuration to the end; c3: every configuration to its rung (c2's twin's
    per-step time, the rung's evaluations, park), the kept ones on to the end (resume)."""
    tot = dict.fromkeys(("setup_s", "train_s", "eval_s", "park_s", "tokens", "samples"), 0.0)
    tot.update(configs_full=0, configs_rung=0, twins={})
    for m in meta:
        p, twin = _pair(arm, m["bs"], m["rank"])
        if twin:
            tot["twins"][f"{m['bs']},{m['rank']}"] = twin
        step_s = p["train_s"] / p["steps"]
        full = kind != "c3" or m["job"] in (keep or []) or m["rung"] >= m["total"]
        steps = m["total"] if full else m["rung"]
        tot["train_s"] += steps * step_s
        tot["tokens"] += m["tokens_total"] if full else m["tokens_rung"]
        tot["samples"] += steps * m["bs"]
        tot["configs_full" if full else "configs_rung"] += 1
        evals = m["evals_full"] if kind != "c3" else m["evals_rung"] + (m["evals_rest"] if full else [])
        tot["eval_s"] += sum(_eval_time(arm, s) for s in evals)
        tot["setup_s"] += p["setup_s"] + (p["teardown_s"] if full else 0.0)
        if kind == "c3" and m["rung"] < m["total"]:
            pr = arm["park_resume"][str(m["rank"])]
            tot["park_s"] += pr["park_s"] + (pr["resume_s"] if full else 0.0)
    fu = arm["first_use"]
    warm, _ = _pair(arm, fu["bs"], fu["rank"])
    tot["first_use_s"] = max(0.0, fu["seconds"] - fu["steps"] * warm["train_s"] / warm["steps"]
                             - _eval_time(arm, fu["eval_size"]))
    tot["load_s"] = arm["load_s"]
    tot["total_s"] = sum(tot[k] for k in ("load_s", "first_use_s", "setup_s", "train_s", "eval_s", "park_s"))
    tot["train_tok_s"] = tot["tokens"] / tot["train_s"]
    tot["mfu"] = 6 * arm["n_backbone"] * tot["train_tok_s"] / PEAK_FLOPS
    tot["e2e_tok_s"] = tot["tokens"] / tot["total_s"]
    return tot


def _estimate(meta: list[dict], arm: dict, kind: str, keep: list[str] | None = None) -> dict | str:
    try:
        return estimate(meta, arm, kind, keep)
    except KeyError as exc:  # a batch size no call measured
        return f"incomplete: {exc}"


# ----------------------------------------------------------------------------- report
def merge(files: list[str]) -> str:
    runs = [(f, json.loads(Path(f).read_text())) for f in files]
    quality: dict[str, dict[int, dict]] = {}
    timing: dict[int, dict[str, Any]] = {}
    for f, r in runs:
        shape = r["args"].get("small_shape", SMALL_SHAPE)
        quality.setdefault(shape, {}).update({int(s): q for s, q in r.get("quality", {}).items()})
        tm = r.get("timing")
        if tm:
            slot = timing.setdefault(tm["layers"], {"meta": tm["jobs"], "arms": {}, "checks": []})
            slot["checks"].append((f, r["env"]["gpu"], tm.get("check")))
            for a in ("c1", "c2"):
                if isinstance(tm.get(a), dict) and "pairs" in tm[a]:
                    slot["arms"][a] = {**tm[a], "file": f, "device": r["env"]["gpu"]}
            slot.setdefault("exec", {}).update(executor_runs(tm, f, r["env"]["gpu"]))
            slot.setdefault("repeats", []).append(call_ratios(f, r))
    return render(runs, quality, timing)


def call_ratios(file: str, r: dict) -> dict:
    """One call's own (a) and baselines at its depth, each ratio within that call (the merged
    table takes each arm from the last call that timed it; this keeps every call's side-by-side)."""
    tm = r["timing"]
    out: dict[str, Any] = {"file": Path(file).name, "device": r["env"]["gpu"]}
    if isinstance(tm.get("a"), dict) and "wall_outer_s" in tm["a"]:
        out["a"] = tm["a"]["wall_outer_s"]
    keep = ((r.get("quality", {}).get(str(tm.get("seed", 0))) or {}).get("c3") or {}).get("keep")
    for name, arm, kind in (("c1", "c1", "c1"), ("c2", "c2", "c2"), ("c3", "c2", "c3")):
        a = tm.get(arm)
        if not (isinstance(a, dict) and "pairs" in a) or (kind == "c3" and ("park_resume" not in a or keep is None)):
            continue
        e = _estimate(tm["jobs"], a, kind, keep if kind == "c3" else None)
        if not isinstance(e, str):
            out[name] = e["total_s"]
            out[f"{name}_measured"] = f"{len(a['pairs'])} of {len(a['pairs']) + len(a['skipped'])}"
    return out


def render_repeats(repeats: list[dict]) -> list[str]:
    if len(repeats) < 2:
        return []
    out = ["", "Each call at this depth on its own (every ratio within one call; pairs measured / all):", "",
           "| call | device | (a) s | (c1) s | (c2) s | (c3) s | (c1)/(a) | (c2)/(a) | (c3)/(a) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for c in repeats:
        a = c.get("a")
        cells = [f"{c[k]:.1f} ({c[k + '_measured']})" if k in c else "-" for k in ("c1", "c2", "c3")]
        ratios = [_ratio(c[k], a) if k in c and a else "-" for k in ("c1", "c2", "c3")]
        out.append(f"| {c['file']} | {c['device']} | {_fmt(a)} | " + " | ".join(cells + ratios) + " |")
    return out


def _ratio(x: float, ref: float | None) -> str:
    return f"{x / ref:.2f}x" if ref else "-"


def executor_runs(tm: dict, file: str, device: str) -> dict:
    """(a) and (b) at the large shape, timed whole through the real executor."""
    return {a: {**tm[a], "file": file, "device": device} for a in ("a", "b")
            if isinstance(tm.get(a), dict) and "wall_outer_s" in tm[a]}


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def render(runs: list, quality: dict, timing: dict) -> str:
    first = runs[0][1]["args"]
    lines = ["# Sequential baselines (issue 33): c1, c2, c3 beside loraplex's executor", "",
             "Calls merged (each arm at each depth timed in the call named):", "",
             "| file | device | torch / transformers / peft | phase | arms | layers | configs | seeds (quality model WxD) | Liger | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for f, r in runs:
        a, e = r["args"], r["env"]
        lines.append(f"| {Path(f).name} | {e['gpu']} | {e['torch']} / {e['transformers']} / {e['peft']} | "
                     f"{a['phase']} | {a['arms']} | {a['layers'] if a['phase'] != 'quality' else '-'} | "
                     f"{a['configs']} | {a['seed']}{'' if a['phase'] == 'timing' else ' (' + a.get('small_shape', SMALL_SHAPE) + ')'} | {r.get('liger', '?')} | {_fmt(r.get('wall_s'))} |")
    lines += ["", f"Task: task_e2e's synthetic Markov language, {first['n_train']} training / {first['n_val']} "
              f"validation samples, max_seq_len {first['seq']}, evaluation every {first['eval_every_samples']} "
              "samples and at the end on the executor's evaluation policy (EvalSettings: sizes by samples "
              "trained, leading subset of one shuffled order); one epoch per configuration; early-exit "
              "defaults (warmup 5% of a job's steps, keep 25%); a job waiting for the ranking "
              + ("trains on (--train-while-waiting)" if first.get("train_while_waiting") else "waits parked")
              + ("; the ranking evaluates each job's whole subset at once (--one-stage-ranking)."
                 if first.get("one_stage_ranking", True) else "; the ranking's evaluation is staged (a lead quarter first).")
              + (" A training key is captured at its job set's last step too (--capture-transient)."
                 if first.get("capture_transient") else "")
              + (" CUBLAS_WORKSPACE_CONFIG unset (--bare-env: not a node's process environment)."
                 if first.get("bare_env", True) else " The process environment a node gives its GPU "
                 "processes (CUBLAS_WORKSPACE_CONFIG set: the samples' prefill on SDPA's math backend).")]
    for layers in sorted(timing):
        lines += render_timing(layers, timing[layers], quality.get(SMALL_SHAPE, {}))
    for shape in sorted(quality, key=lambda s: s != SMALL_SHAPE):
        lines += render_quality(quality[shape], shape)
    lines += render_checks(quality, timing)
    lines += NOTES
    return "\n".join(lines) + "\n"


def _sum_opt(r: dict, *keys: str) -> float | None:
    """Sum of the keys a run reported (older runs lack the finer phases: None)."""
    vals = [r[k] for k in keys if k in r]
    return sum(vals) if vals else None


def render_timing(layers: int, slot: dict, quality: dict) -> list[str]:
    meta, arms, runs = slot["meta"], slot["arms"], slot.get("exec", {})
    out = ["", f"## Time to the best adapter, Llama-3.1-8B shape, {layers} layers", "",
           "| arm | total s | x (a) | load | first use | PEFT attach/detach | park/resume | train | eval | "
           "configs full + rung only | samples | train tokens | train tok/s | MFU (train) | tok/s end to end | measured in |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ref = runs["a"]["wall_outer_s"] if "a" in runs else None
    # a baseline arm counts its model's weights; an (a)-only run: the same count from the shape's config
    n_backbone = (next((a["n_backbone"] for a in arms.values() if "n_backbone" in a), None)
                  or config_matmul_params(llama8b_config(layers)))
    for key, name in (("a", "(a) loraplex executor, early exit"), ("b", "(b) loraplex executor, no early exit")):
        if key not in runs:
            continue
        r = runs[key]
        st = list(r["statuses"].values()) if isinstance(r.get("statuses"), dict) else []
        full = sum(1 for v in st if str(v).startswith("completed"))
        # tokens as the baselines count them (every token of every sample of the steps trained)
        tokens = sum(sum(m["step_tokens"][:r["job_steps"].get(m["job"], 0)]) for m in meta)
        tok_s = tokens / r["train_s"] if r.get("train_s") else math.nan
        mfu = 6 * n_backbone * tok_s / PEAK_FLOPS if n_backbone else math.nan
        out.append(f"| {name} | {r['wall_outer_s']:.1f} | {_ratio(r['wall_outer_s'], ref)} | {r['load_s']:.1f} | "
                   f"{r['profile_s']:.1f} (memory profile) | {_fmt(r.get('init_s'))} (adapter init) | "
                   f"{_fmt(_sum_opt(r, 'park_s', 'resume_s'))} | {r['train_s']:.1f} | {r['eval_s']:.1f} | "
                   f"{full} + {len(st) - full} | {int(r['samples'])} | {tokens} | {tok_s:,.0f} | "
                   f"{_fmt(mfu * 100)}% | {tokens / r['wall_outer_s']:,.0f} | {Path(r['file']).name} ({r['device']}) |")
    notes = []
    for key, r in runs.items():
        notes.append(f"\n({key}): {r['steps']} engine steps, at most {r['max_total_batch']} sequences a step, "
                   f"recompute {r.get('recompute', '?')} ({r.get('no_recompute_steps', '?')} steps without), "
                   f"first step at {_fmt(r.get('first_step_s'))} s, replayed losses missing {r['missing_trace_points']}, "
                   f"other admission (bookkeeping, arena copies) {_fmt(r.get('admit_s'))} s, checkpoints "
                   f"{_fmt(r.get('checkpoint_s'))} s, exports {_fmt(r.get('export_s'))} s"
                   + (f", decisions equal the small model's: {r['decisions_match_small']}"
                      if "decisions_match_small" in r else ""))
    rows = []
    if "c1" in arms:
        rows.append(("(c1) PEFT, padded, one at a time", _estimate(meta, arms["c1"], "c1"), arms["c1"]))
    if "c2" in arms:
        rows.append(("(c2) PEFT packed + varlen + Liger + fused AdamW", _estimate(meta, arms["c2"], "c2"), arms["c2"]))
        for seed in sorted(quality):
            keep = (quality[seed].get("c3") or {}).get("keep")
            if keep is not None and "park_resume" in arms["c2"]:
                rows.append((f"(c3) (c2) + successive halving, seed {seed} decisions",
                             _estimate(meta, arms["c2"], "c3", keep), arms["c2"]))
    for name, e, a in rows:
        if isinstance(e, str):
            out.append(f"| {name} | {e} |" + " |" * 14)
            continue
        out.append(f"| {name} | {e['total_s']:.1f} | {_ratio(e['total_s'], ref)} | {e['load_s']:.1f} | {e['first_use_s']:.1f} | {e['setup_s']:.1f} | "
                   f"{e['park_s']:.1f} | {e['train_s']:.1f} | {e['eval_s']:.1f} | {e['configs_full']} + {e['configs_rung']} | "
                   f"{int(e['samples'])} | {int(e['tokens'])} | {e['train_tok_s']:,.0f} | {e['mfu']:.1%} | "
                   f"{e['e2e_tok_s']:,.0f} | {Path(a['file']).name} ({a['device']}) |")
    out += notes
    out += render_repeats(slot.get("repeats", []))
    for name, a in arms.items():
        ck = a.get("checkpointing")
        ck = (json.dumps({k: v["checkpointing"] for k, v in ck.items()}) if ck else
              "always (c1 as today)" if name == "c1" else "off (no probe off CUDA)")
        out.append(f"\n{name}: load {a['load_s']:.1f} s, attention {a['setup']['attention']}, Liger: {a.get('liger')}, "
                   f"activation checkpointing by batch size {ck}"
                   f"; measured (batch size, rank): {', '.join(a['pairs'])}"
                   + (f"; not measured (deadline: twin = nearest rank): {', '.join(a['skipped'])}" if a["skipped"] else ""))
    return out


def render_quality(quality: dict, shape: str = SMALL_SHAPE) -> list[str]:
    if not quality:
        return []
    seeds = sorted(quality)
    width, depth = shape.split("x")
    out = ["", f"## Quality: best validation loss of each arm (small Llama, {depth} layers x {width} wide, "
           f"seeds {', '.join(map(str, seeds))})", "",
           "| arm | best val, mean over seeds | ratio to (b), mean | per seed (best / ratio) | best configuration, seed "
           f"{seeds[0]} | samples trained, seed {seeds[0]} | per-configuration best val vs (b): median / max abs delta |",
           "|---|---|---|---|---|---|---|"]
    names = {"b": "(b) loraplex, no early exit", "a": "(a) loraplex, early exit", "c1": "(c1) PEFT one at a time",
             "c2": "(c2) strong sequential", "c3": "(c3) (c2) + successive halving"}
    for k, label in names.items():
        got = [(s, quality[s][k]) for s in seeds if quality[s].get(k)]
        if not got:
            continue
        bests = [q["best"] for _, q in got]
        ratios = [q["best"] / quality[s]["b"]["best"] for s, q in got]
        q0 = got[0][1]
        d = q0.get("vs_b_abs_delta")
        out.append(f"| {label} | {statistics.fmean(bests):.4f} | {statistics.fmean(ratios):.4f} | "
                   + "; ".join(f"{s}: {q['best']:.4f} / {r:.4f}" for (s, q), r in zip(got, ratios, strict=True))
                   + f" | {q0['best_job']} | {int(q0['samples'])} | "
                   + (f"{d['median']:.4f} / {d['max']:.4f}" if d else "-") + " |")
    for s in seeds:
        c3 = quality[s].get("c3")
        if c3:
            out.append(f"\nseed {s}: c3 kept {', '.join(c3['keep'])}; (a)'s ranking kept "
                       f"{', '.join(quality[s]['a'].get('keep') or [])} (same set: {c3['keep_same_as_a']}); "
                       f"c3 survivors' validation losses vs c2's at the same steps, max |delta|: {_fmt(c3.get('survivors_vs_c2_max_abs_delta'), '.2e')}")
    return out


def render_checks(quality: dict, timing: dict) -> list[str]:
    out = ["", "## Step 0: the baselines' loss equals loraplex's engine's (same configuration, same batch)", "",
           "| where | configuration | tokens | engine | c1 | c2 | engine, B != 0 | c1, B != 0 | c2, B != 0 | agree |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    items = [(f"small model {shape}, seed {s}", q.get("check"))
             for shape, by_seed in sorted(quality.items()) for s, q in sorted(by_seed.items())]
    items += [(f"{layers} layers, {f} ({gpu})", c) for layers, slot in sorted(timing.items()) for f, gpu, c in slot["checks"]]
    for where, c in items:
        if not c:
            continue
        out.append(f"| {where} | {c['job']} | {c['tokens']} | " + " | ".join(
            _fmt(c.get(k), ".6f") for k in ("engine", "c1", "c2", "engine_lora", "c1_lora", "c2_lora"))
            + f" | {_agree(c)} (tolerance {'1e-4' if c['fp32'] else '1e-2 x loss'}) |")
    return out


def _agree(check: dict) -> str:
    """The row's verdict: "n/a" where no baseline arm ran to compare with the engine."""
    if not check.get("verdict"):
        return "n/a (no baseline arm ran)"
    return "yes" if check["ok"] else "NO"


NOTES = ["", "## How these numbers are made", "",
         "- Time of an arm = model load (weights to the device, data tokenised, the arm's patches) + one-time "
         "first-use costs (a warm-up configuration's 3 steps and one evaluation, minus their steady-state time) "
         "+ per configuration: PEFT attach (get_peft_model, init, optimizer) and detach (unload), its training "
         "steps, its evaluations, and for (c3) parking its state on the host and resuming it. Not counted: "
         "c2's one-off probe of which batch sizes need activation checkpointing (a practitioner's trial run).",
         "- Measured at the large shape: ONE configuration per (batch size, rank) of the grid, trained whole "
         "(all its steps, evaluations, attach/detach); every other configuration of that batch size and rank "
         "costs the same (one epoch of the same examples in its own order: the same steps, tokens and "
         "evaluations). Evaluation seconds per evaluation size are the medians of the measured ones. (c3) "
         "replays the quality phase's decisions (its real successive-halving run on the small model): every "
         "configuration's rung steps at its twin's mean step time, the rung and later evaluations by the "
         "policy, park/resume measured per rank. Extrapolated, as bench/task_e2e.py does for its PEFT arm.",
         "- Train tok/s = real (non-pad) tokens of the training steps / seconds of training steps; "
         "MFU = 6 x N x tokens / seconds / 989e12 with N = the backbone's matmul parameters (decoder "
         "linears + LM head, embeddings excluded), the conventional count for every arm alike: recomputed "
         "activations (checkpointing) and LoRA's own FLOPs are not counted.",
         "- Quality: the small Llama pretrained on chain A learns chain B through every arm from the engine's "
         "adapter init (JobAdapter, the job's seed), in each job's data order, with its AdamW and linear "
         "schedule; (a) and (b) are loraplex's executor on the same files. c1/c2 evaluate with the "
         "executor's policy; c3 adds the rung evaluation (a)'s ranking makes. Differences from (b) per "
         "configuration come from numerics (bf16, kernels) and from the engine skipping non-finite updates "
         "(the diverging end), which PEFT does not.",
         "- c1 differs from bench/task_e2e.py's peft_job only in using the job's own AdamW settings "
         "(weight decay 0: peft_job left torch's default 0.01) and reporting the token-mean validation loss."]


def merge_one(res: dict) -> str:
    quality = {res["args"].get("small_shape", SMALL_SHAPE): {int(s): q for s, q in res.get("quality", {}).items()}}
    timing = {}
    tm = res.get("timing")
    if tm:
        timing[tm["layers"]] = {"meta": tm["jobs"], "checks": [("this call", res["env"]["gpu"], tm.get("check"))],
                                "arms": {a: {**tm[a], "file": "this call", "device": res["env"]["gpu"]}
                                         for a in ("c1", "c2") if isinstance(tm.get(a), dict) and "pairs" in tm[a]},
                             "exec": executor_runs(tm, "this call", res["env"]["gpu"])}
    return render([("this call", res)], quality, timing)
