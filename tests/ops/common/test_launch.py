"""runtime/ops/common/launch.py: which compiled kernel a launch reuses. A compiled Triton kernel needs a GPU,
so the kernel here is a stand-in recording how it is called (the GPU benches and tier 0 run the real path:
bench/bench_gated_delta.py checks every output against fp64)."""
import pytest

import torch

from runtime.ops.common import launch


class Compiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("launcher", grid, args))


class StandInKernel:
    """Has what FastLaunch reads of a @triton.jit kernel: `fn` (its signature) and kernel[grid](...)."""

    def __init__(self):
        self.log = []

        def fn(x_ptr, n, scale, BLOCK, FLAG=False):
            pass

        self.fn = fn

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return Compiled(self.log)
        return run


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return StandInKernel()


def test_same_key_reuses_the_compiled_launcher_with_every_parameter_in_order(kernel):
    x = torch.zeros(64)
    fast = launch.FastLaunch(kernel)
    fast[(4,)](x, 8, 0.5, BLOCK=16, num_warps=4)
    fast[(2, 3)](x, 8, 0.25, BLOCK=16, num_warps=4)
    assert [entry[0] for entry in kernel.log] == ["jit", "launcher"]
    # a float is not part of the key; the constexprs follow the positional arguments, defaults filled in,
    # the launch option (num_warps) is not a parameter; the grid padded to three dimensions
    assert kernel.log[1] == ("launcher", (2, 3, 1), (x, 8, 0.25, 16, False))


def test_what_triton_specializes_on_compiles_again(kernel):
    fast = launch.FastLaunch(kernel)
    base = torch.zeros(64)
    calls = [(base, 8, {}), (base.to(torch.float64), 8, {}), (base[1:], 8, {}), (base, 16, {}),
             (base, 8, {"FLAG": True}), (base, 8, {"num_warps": 8}), (None, 8, {})]
    for x, n, extra in calls:
        fast[(1,)](x, n, 1.0, BLOCK=16, **extra)
    # dtype, 16-byte alignment (base[1:] starts 4 bytes in), an int's value, a constexpr, a launch option, a None
    # pointer (Triton takes it as a constexpr)
    assert [entry[0] for entry in kernel.log] == ["jit"] * len(calls)


def test_under_the_interpreter_every_launch_goes_through_triton(kernel, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fast = launch.FastLaunch(kernel)
    for _ in range(2):
        fast[(1,)](torch.zeros(4), 8, 1.0, BLOCK=16)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit"]
