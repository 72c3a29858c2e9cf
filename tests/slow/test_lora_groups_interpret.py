"""Sibling groups of the fused multi-LoRA operator (kernels.fused_groups; trainer.multilora.SiblingGroup under
$LORAPLEX_LORA_GROUPS=1) on the CPU under Triton's interpreter: one grouped call equals each sibling's own fused
call (outputs, dX, every adapter's gradients added into the arena), and the engine's steps with q/k/v and gate/up
grouped equal its steps without. The kernels on a GPU: tests/gpu/test_lora_groups_gpu.py."""

from __future__ import annotations

import pytest

from tests.helpers.interpreted import run_interpreted

pytest.importorskip("triton")

_OPERATOR = r"""
from kernels.testing import group_against_siblings

for args in (
    ([5, 0, 9], [8, 16, 4], 24, [32, 8, 8], torch.float32, True, False, True, True),     # q/k/v-like, an empty job
    ([7, 3], [16, 8], 16, [40, 40], torch.float64, False, True, True, True),             # gate/up-like, aligned
    ([4, 6, 2], [4, 24, 8], 20, [12, 28, 12], torch.float64, True, False, False, False),  # first layer, two passes
    ([0, 0], [8, 8], 16, [16, 16], torch.float32, False, False, True, True),             # no rows at all
):
    out[str(args)] = group_against_siblings(*args)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_grouped_call_equals_each_siblings_own_fused_call() -> None:
    res = run_interpreted(_OPERATOR)
    assert len(res) == 4
    for name, r in res.items():
        assert not r["nan"], name  # nothing outside an adapter's blocks (the NaN gaps) was read
        assert r["y"] <= 1e-6 and r["dx"] <= 1e-6 and r["grad"] <= 1e-6, (name, r)
        assert name.startswith("([0, 0],") == (r["moved"] == 0.0), (name, r)  # gradients reached the arena


_ENGINE = r"""
from collections import Counter
import kernels.fused_groups as fg
from tests.helpers.tiny_engine import tiny_engine_steps
from kernels.tuned import Tuned
from trainer import multilora

calls, launches = [], Counter()
real = fg.FusedGroupArenaFn.forward
fg.FusedGroupArenaFn.forward = staticmethod(lambda ctx, x, *a: calls.append(len(a) - 11) or real(ctx, x, *a))
real_run = Tuned.run_config
Tuned.run_config = lambda self, *a: launches.update([self.name]) or real_run(self, *a)


def run(grouped):
    multilora.GROUPS = grouped
    return tiny_engine_steps("triton", "fused")


plain, plain_w = run(False)
n_plain, plain_launches = len(calls), dict(launches)
launches.clear()
grouped, grouped_w = run(True)
out.update(plain=plain, grouped=grouped, plain_calls=n_plain, group_calls=calls[n_plain:],
           weights=max(rel(a, b) for a, b in zip(grouped_w, plain_w)), plain_launches=plain_launches,
           grouped_launches=dict(launches))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_engine_steps_with_siblings_grouped_equal_the_steps_without() -> None:
    """Two steps of the real engine on the fused form (recompute, per-job AdamW) with q/k/v and gate/up grouped
    give the ungrouped steps' losses and weights; every layer's two groups ran as one node each, so a layer's
    forward launches 4 shrinks instead of 7 and its backward 4 dA passes instead of 7."""
    res = run_interpreted(_ENGINE)
    assert res["plain_calls"] == 0
    # q/k/v and gate/up: 3 and 2 siblings, each with a weight and a bias argument
    assert res["group_calls"] and sorted(set(res["group_calls"])) == [4, 6], res["group_calls"]
    plain, grouped = res["plain_launches"], res["grouped_launches"]
    forwards = plain["shrink"] // 7  # a layer's forwards (recompute runs it again in the backward)
    assert forwards >= 2 and plain["shrink"] == 7 * forwards and "shrink_group" not in plain, plain
    assert grouped["shrink"] == 2 * forwards and grouped["shrink_group"] == 2 * forwards, grouped  # o, down + 2 groups
    assert grouped["shrink_wgrad"] == plain["shrink_wgrad"]  # dS (and dB) read each sibling's own dY
    assert grouped["wgrad"] + grouped["wgrad_group"] == plain["wgrad"] - 3 * plain["wgrad"] // 7, (plain, grouped)
    assert res["plain"][0] != res["plain"][1]
    for step_plain, step_grouped in zip(res["plain"], res["grouped"], strict=True):
        for a, b in zip(step_grouped, step_plain, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), res
    assert res["weights"] <= 1e-5, res
