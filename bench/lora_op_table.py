"""bench/lora_op.py's table: one row per case (times, ratios, errors), its header, and the issue-20
target lines."""

from __future__ import annotations

import math

KEY = (4096, 4096, 8, 1024)


def ratio(p: float, q: float) -> str:
    return f"{p / q:.2f}" if q and math.isfinite(p) and math.isfinite(q) else "n/a"


def row_line(label, n, per, rn, t, e, r16=None) -> str:
    c = t.get("c", float("nan"))
    b = t.get("b", float("nan"))
    e16 = ratio(t["e"], r16["e"]) if r16 else "-"
    errs = "/".join(f"{e[k]:.1e}" if k in e else "-" for k in ("b", "c", "d", "e", "e2", "e3"))
    return (f"| {label} | {n} | {per} | {rn} | {t['a']:.3f} | {b:.3f} | {c:.3f} | {t['d']:.3f} | {t['e']:.3f}"
            f" | {t['e2']:.3f} | {t['e3']:.3f} | {ratio(t['d'], t['a'])} | {ratio(t['e'], t['a'])} | {ratio(c, t['e'])}"
            f" | {e16} | {t['ag']:.3f} | {t['dg']:.3f} | {t['eg']:.3f} | {ratio(t['dg'], t['ag'])}"
            f" | {ratio(t['eg'], t['ag'])} | {errs} |")


HEADER = ["| d_in x d_out | N | tok/adapter | ranks | (a) floor | (b) loop | (c) bmm | (d) compose | (e) fused"
          " | (e2) fused 2-pass dB | (e3) fused TMA | d/a | e/a | c/e | e/e16 | (a) graph | (d) graph | (e) graph"
          " | d/a graph | e/a graph | max rel err b/c/d/e/e2/e3 |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def targets(results: dict) -> list[str]:
    """The issue-20 targets from the table's rows (eager and graph ratios side by side)."""
    out = []
    key = results.get(KEY + ("r16",))
    if key:
        out.append(f"target: fused (e)/(a) <= 1.15 at 4096, N=8, 1024 tok, r16: eager {key['e'] / key['a']:.3f},"
                   f" graph {key['eg'] / key['ag']:.3f} (compose (d)/(a): {key['d'] / key['a']:.3f},"
                   f" graph {key['dg'] / key['ag']:.3f})")
    ea = [t["e"] / t["a"] for t in results.values()]
    eag = [t["eg"] / t["ag"] for t in results.values() if math.isfinite(t["eg"])]
    if ea:
        out.append(f"target: (e)/(a) <= 1.2 across the table: max eager {max(ea):.2f}"
                   + (f", max graph {max(eag):.2f}" if eag else ""))
    mix = [(k, t["e"] / results[k[:4] + ("r16",)]["e"]) for k, t in results.items()
           if k[4] == "mixed" and k[:4] + ("r16",) in results]
    if mix:
        out.append(f"target: mixed within 1.1x of uniform r16 (e mixed / e r16): max {max(v for _, v in mix):.2f},"
                   f" min {min(v for _, v in mix):.2f}")
    cm = [t["c"] / t["e"] for k, t in results.items() if k[4] == "mixed" and "c" in t]
    if cm:
        out.append(f"target: (c)/(e) >= 1.25 with mixed ranks: min {min(cm):.2f}, max {max(cm):.2f}")
    best = [min(t["d"], t["e"]) / t["a"] for t in results.values()]
    if best:
        out.append(f"per-shape choice (faster of d and e, what form='auto' picks): max ratio to (a) {max(best):.2f}")
    return out
