"""The slow tier: unit-level cases that cost seconds to minutes each on a 2-core machine (the
Triton interpreter over the kernels, an sm_90 compile, 2 gloo ranks, a real worker daemon and
its host process, the colocation fuzzer). Same standards as tests/unit; `scripts/run-tests.sh`
runs every tier, `pytest tests/unit` stays the fast one."""

from tests.unit.conftest import one_thread  # noqa: F401 (the same fixture, opted into per module)
