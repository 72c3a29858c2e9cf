"""`kernels.lean_launch`: after Triton has launched a specialization once, the same specialization
goes straight to the compiled kernel's launcher (arguments in the kernel's parameter order, the
grid padded to three axes, the current stream); anything Triton would specialize differently, or
that the path does not cover, goes through Triton again. A stand-in JIT function and compiled
kernel record which path ran (no CUDA here); tests/gpu/test_lean_launch_gpu.py runs the real one."""

from __future__ import annotations

import pytest
import torch

from kernels import lean_launch as ll


class FakeKernel:
    """Stands in for triton's CompiledKernel: `run` is its launcher."""

    packed_metadata = ("meta",)
    function = 0xF00

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def run(self, *args: object) -> None:
        self.calls.append(args)


class FakeJit:
    """Stands in for a triton.jit function with parameters (x_ptr, n, flag, BLOCK): a launch through
    it returns one compiled kernel per distinct keyword set, as Triton's run returns its kernel."""

    arg_names = ["x_ptr", "n", "flag", "BLOCK"]

    class Param:
        def __init__(self, is_constexpr: bool) -> None:
            self.is_constexpr = is_constexpr

    params = [Param(False), Param(False), Param(False), Param(True)]

    def __init__(self) -> None:
        self.launches: list[tuple] = []
        self.kernels: dict[tuple, FakeKernel] = {}
        self.pre_run_hooks: list = []

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def run(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            self.launches.append((grid if callable(grid) else tuple(grid), args, kw))
            return self.kernels.setdefault(tuple(sorted(kw.items())), FakeKernel())
        return run


@pytest.fixture
def lean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ll, "ENABLED", True)
    monkeypatch.setattr(ll, "_device_and_stream", lambda: (0, 77))
    monkeypatch.setattr(ll, "_triton_only", lambda: False)
    monkeypatch.setattr(ll, "_CACHE", {})
    monkeypatch.setattr(ll, "_KEPT", {})


def test_a_repeated_specialization_goes_straight_to_the_launcher(lean: None) -> None:
    fn, x = FakeJit(), torch.zeros(64)
    kw = {"BLOCK": 32, "num_warps": 4, "num_stages": 3}
    ll.launch(fn, (5,), (x, 40, True), kw)
    assert len(fn.launches) == 1  # the first launch of a specialization is Triton's
    kernel = next(iter(fn.kernels.values()))
    assert kernel.calls == []
    ll.launch(fn, (6, 2), (x, 72, True), kw)  # 72: as 40, neither 1 nor a multiple of 16
    assert len(fn.launches) == 1
    assert kernel.calls == [(6, 2, 1, 77, 0xF00, ("meta",), None, None, None, x, 72, True, 32)]


@pytest.mark.parametrize("change", ["misaligned", "dtype", "one", "multiple_of_16", "wide_int", "flag", "keyword"])
def test_what_triton_specializes_on_goes_through_triton_again(lean: None, change: str) -> None:
    fn, x = FakeJit(), torch.zeros(64)
    args, kw = [x, 40, True], {"BLOCK": 32, "num_warps": 4}
    ll.launch(fn, (1,), tuple(args), kw)
    if change == "misaligned":
        args[0] = torch.zeros(64)[1:]  # 4 bytes past an aligned start
        assert args[0].data_ptr() % 16 != 0
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "one":
        args[1] = 1
    elif change == "multiple_of_16":
        args[1] = 48
    elif change == "wide_int":
        args[1] = 2**33 + 3
    elif change == "flag":
        args[2] = False
    else:
        kw = {**kw, "BLOCK": 64}
    ll.launch(fn, (1,), tuple(args), kw)
    assert len(fn.launches) == 2
    ll.launch(fn, (1,), tuple(args), kw)  # and that one is then cached on its own
    assert len(fn.launches) == 2


def test_launch_hooks_unknown_kinds_and_unnamed_parameters_keep_triton_s_path(
        lean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fn, x = FakeJit(), torch.zeros(64)
    kw = {"BLOCK": 32, "num_warps": 4}
    ll.launch(fn, (1,), (x, 40, True), kw)
    monkeypatch.setattr(ll, "_triton_only", lambda: True)  # a profiler's launch hooks see every launch
    ll.launch(fn, (1,), (x, 40, True), kw)
    assert len(fn.launches) == 2
    monkeypatch.setattr(ll, "_triton_only", lambda: False)
    for _ in range(2):
        ll.launch(fn, (1,), (x, [40], True), kw)  # an argument kind the key does not cover
    assert len(fn.launches) == 4
    for _ in range(2):
        ll.launch(fn, (1,), (x, 40), kw)  # "flag" neither positional nor a keyword: never cached
    assert len(fn.launches) == 6
    for _ in range(2):
        ll.launch(fn, (1,), (x, 40), {**kw, "flag": True})  # a keyword that is no constexpr: never cached
    assert len(fn.launches) == 8
    for _ in range(2):
        ll.launch(fn, lambda meta: (1,), (x, 40, True), kw)  # a callable grid
    assert len(fn.launches) == 10
    hooked = FakeJit()
    hooked.pre_run_hooks.append(print)
    for _ in range(2):
        ll.launch(hooked, (1,), (x, 40, True), kw)
    assert len(hooked.launches) == 2


def test_off_or_without_cuda_every_launch_is_triton_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ll, "_CACHE", {})
    monkeypatch.setattr(ll, "_triton_only", lambda: False)
    fn, x = FakeJit(), torch.zeros(64)
    monkeypatch.setattr(ll, "ENABLED", True)

    def no_cuda() -> tuple[int, int]:
        raise RuntimeError("no CUDA device")

    monkeypatch.setattr(ll, "_device_and_stream", no_cuda)
    for _ in range(2):
        ll.launch(fn, (1,), (x, 40, True), {"BLOCK": 32})
    monkeypatch.setattr(ll, "ENABLED", False)
    monkeypatch.setattr(ll, "_device_and_stream", lambda: (0, 77))
    for _ in range(2):
        ll.launch(fn, (1,), (x, 40, True), {"BLOCK": 32})
    assert len(fn.launches) == 4
    assert all(k.calls == [] for k in fn.kernels.values())


def test_triton_s_debug_and_instrumentation_modes_take_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    knobs = pytest.importorskip("triton").knobs
    assert not ll._triton_only()
    monkeypatch.setattr(knobs.runtime, "debug", True)
    assert ll._triton_only()
    monkeypatch.setattr(knobs.runtime, "debug", False)
    monkeypatch.setattr(knobs.compilation, "instrumentation_mode", "consan")
    assert ll._triton_only()


def test_an_empty_hook_chain_is_no_hook() -> None:
    chain = pytest.importorskip("triton.knobs").HookChain()  # knobs.runtime.launch_enter_hook's kind in 3.6
    assert not ll._installed(None)
    assert not ll._installed(chain)
    chain.add(print)
    assert ll._installed(chain)
    assert ll._installed(print)  # an older Triton's plain callable


def test_a_parameter_is_keyed_as_the_tensor_it_is() -> None:
    p = torch.nn.Parameter(torch.zeros(8))
    assert ll._specs([p, 3, 32, 1, None, 2.0, True, 2**63]) == [
        (torch.float32, True), (False, False, True, False), (False, True, True, False), (True, False, True, False),
        (type(None), None), (float, 2.0), (bool, True), (False, True, False, True)]


def test_the_kept_specializations_are_bounded_per_kernel(lean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ll, "MAX_ENTRIES", 2)
    fn, other, x = FakeJit(), FakeJit(), torch.zeros(64)
    for eps in (0.1, 0.2, 0.3, 0.3):  # a float's value is in the key: the third one is not kept
        ll.launch(fn, (1,), (x, eps, True), {"BLOCK": 32})
    assert len(ll._CACHE) == 2
    assert len(fn.launches) == 4
    for _ in range(2):  # another kernel keeps its own
        ll.launch(other, (1,), (x, 0.1, True), {"BLOCK": 32})
    assert len(other.launches) == 1
