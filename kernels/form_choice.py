"""Per-shape choice between the two Triton forms of the operator, from measured timings.

"compose": cuBLAS base GEMMs plus separate LoRA passes (`kernels.triton_lora`).
"fused":   Triton GEMMs with the LoRA terms in their epilogues (`kernels.fused_lora`).

Which is faster depends on the shape (a Triton GEMM may trail cuBLAS on some shapes) and the
device, so form="auto" looks the shape up in a table of forward+backward timings that
`bench/lora_op.py --timings FILE` writes: the point measured on the same device and (d_in,
d_out) nearest in log2(T) and log2(r_max) decides (GPU time, CUDA-graph replay). No measurement
for the device and shape: the caller's fallback (kernels.multilora passes the device's default
form; `DEFAULT_FORM` otherwise). The table is read from $LORAPLEX_LORA_TIMINGS, else from
`kernels/lora_forms.json` when that file exists.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

FORMS = ("compose", "fused")
DEFAULT_FORM = "compose"
_TABLE_FILE = Path(__file__).with_name("lora_forms.json")


class FormTable:
    """Measured fwd+bwd milliseconds per (device, d_in, d_out, T, r_max, form)."""

    def __init__(self, rows: list[dict] | None = None) -> None:
        self._points: dict[tuple[str, int, int], dict[tuple[int, int], dict[str, float]]] = {}
        self._memo: dict[tuple, str] = {}
        for row in rows or []:
            self.add(row["device"], row["d_in"], row["d_out"], row["tokens"], row["r_max"], row["form"], row["ms"])

    def add(self, device: str, d_in: int, d_out: int, tokens: int, r_max: int, form: str, ms: float) -> None:
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {form!r}")
        if not (ms > 0 and math.isfinite(ms)):
            return  # a failed measurement decides nothing
        pts = self._points.setdefault((device, int(d_in), int(d_out)), {})
        pts.setdefault((int(tokens), int(r_max)), {})[form] = float(ms)
        self._memo.clear()

    def rows(self) -> list[dict]:
        return [{"device": dev, "d_in": d_in, "d_out": d_out, "tokens": t, "r_max": r, "form": f, "ms": ms}
                for (dev, d_in, d_out), pts in sorted(self._points.items())
                for (t, r), forms in sorted(pts.items()) for f, ms in sorted(forms.items())]

    def choose(self, device: str, d_in: int, d_out: int, tokens: int, r_max: int,
               fallback: str = DEFAULT_FORM) -> str:
        """The faster form at the nearest measured point with both forms timed, else `fallback`
        (the caller's default for the device: no measurement for this device and shape)."""
        key = (device, d_in, d_out, tokens, r_max, fallback)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        form = fallback
        pts = self._points.get((device, d_in, d_out), {})
        both = [(p, f) for p, f in pts.items() if all(k in f for k in FORMS)]
        if both:
            def dist(p: tuple[int, int]) -> tuple[float, float]:
                return (abs(math.log2(max(p[0], 1)) - math.log2(max(tokens, 1))),
                        abs(math.log2(max(p[1], 1)) - math.log2(max(r_max, 1))))
            _, forms = min(both, key=lambda pf: dist(pf[0]))
            form = min(FORMS, key=lambda f: forms[f])
        self._memo[key] = form
        return form

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"rows": self.rows()}, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> FormTable:
        data = json.loads(Path(path).read_text())
        return cls(data.get("rows", []))


_table: FormTable | None = None


def table() -> FormTable:
    """The process's table (loaded once)."""
    global _table
    if _table is None:
        path = os.environ.get("LORAPLEX_LORA_TIMINGS") or (_TABLE_FILE if _TABLE_FILE.exists() else None)
        _table = FormTable.load(path) if path else FormTable()
    return _table


def set_table(t: FormTable | None) -> None:
    """Replace the process's table (None: load it again from the file on next use)."""
    global _table
    _table = t
