"""runtime/ops/common/backend.py: each op's selector picks torch / triton / hopper once per situation, logs it once,
and `force` pins every op (alignment tier 0's two runs); runtime.dispatch.op follows it."""
import logging

import pytest
import torch

from runtime import dispatch
from runtime.ops.common.backend import Selector, force
from runtime.registry import OPS

CPU = torch.device("cpu")


def test_cpu_runs_the_torch_form_unless_forced():
    selector = Selector("runtime.ops.example.backend", ("torch", "triton", "hopper"))
    assert selector.choose(CPU) == "torch"
    assert selector.choose(None) == "torch"
    with force("triton"):
        assert selector.choose(CPU) == "triton"
    # the fastest fused path a CPU has is the Triton kernels (the Gluon twins need an sm_90 GPU)
    with force("hopper"):
        assert selector.choose(CPU) == "triton"
    with force("torch"):
        assert selector.choose(CPU) == "torch"
    assert selector.choose(CPU) == "torch"


def test_an_op_without_gluon_twins_never_chooses_hopper():
    selector = Selector("runtime.ops.example.backend", ("torch", "triton"))
    with force("hopper"):
        assert selector.choose(CPU) == "triton"


def test_the_choice_is_logged_once_per_situation(caplog):
    selector = Selector("runtime.ops.example.backend", ("torch", "triton"))
    with caplog.at_level(logging.INFO, logger="runtime.ops.example.backend"):
        for _ in range(3):
            selector.choose(CPU)
        with force("triton"):
            selector.choose(CPU)
            selector.choose(CPU)
    assert [r.getMessage() for r in caplog.records] == ["example on cpu: torch", "example on cpu: triton (forced triton)"]


def test_force_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match="'fused'"):
        with force("fused"):
            pass


@pytest.mark.parametrize("name", [name for name, family in OPS.items() if family.kernel])
def test_dispatch_follows_the_selector(name):
    family = OPS[name]
    assert dispatch.selector(family).op == family.kernel.split(":")[0].split(".")[2]
    assert dispatch.op(name, CPU) is family.resolve("torch_form")
    with force("torch"):
        assert dispatch.op(name, CPU) is family.resolve("torch_form")
    with force("triton"):
        assert dispatch.op(name, CPU) is family.resolve("kernel")
