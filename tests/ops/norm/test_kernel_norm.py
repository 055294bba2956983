"""The RMSNorm kernels (runtime/ops/norm/kernel.py) under TRITON_INTERPRET=1 vs the fp64 reference: forward and the
gradients of x, the gate and the weight, plain / "1+w" / silu- and sigmoid-gated; widths that are not a power
of two, rows that leave the last block partial, a backward whose programs walk several row blocks (the
persistent grid cut to two programs); NaN-prefilled buffers. fp32 and bf16 (no tl.dot here, so the
interpreter's bf16 is exact enough).

Shape legend: B batch, T tokens, H heads, D normalized width.
"""
import pytest
import torch

from reference_ops import norms as ref
from runtime.ops.norm import kernel as kernels
from tests.opcheck import check_op

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("nan_buffers")]

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# B2-T63-D96: 126 rows, 42 per block, the width not a power of two; B1-T1-D7: one row of 7;
# B1-T9-H4-D130: head-wide rows under leading dims, 130 columns in a 256-wide block
SHAPES = {"B2-T63-D96": (2, 63, 96), "B1-T1-D7": (1, 1, 7), "B1-T9-H4-D130": (1, 9, 4, 130)}
EPS = 1e-6


@pytest.fixture(params=[False, True], ids=["grid", "two-programs"])
def persistent(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(kernels, "MAX_PROGRAMS", 2)


@pytest.mark.usefixtures("persistent")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["w", "1+w"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_rms_norm_matches_reference(shape, offset, dtype):
    torch.manual_seed(0)
    dims = SHAPES[shape]
    inputs = {"x": torch.randn(dims) * 3, "weight": torch.randn(dims[-1]) * 0.5 + (1 - offset)}
    check_op("rms_norm", kernels.rms_norm, ref.rms_norm, inputs, dtype, eps=EPS, offset=offset)


@pytest.mark.usefixtures("persistent")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gated_rms_norm_matches_reference(shape, activation, dtype):
    torch.manual_seed(1)
    dims = SHAPES[shape]
    inputs = {"x": torch.randn(dims), "gate": torch.randn(dims) * 2, "weight": torch.randn(dims[-1]) * 0.5 + 1}
    check_op("gated_rms_norm", kernels.gated_rms_norm, ref.gated_rms_norm, inputs, dtype, eps=EPS,
             activation=activation)


def test_frozen_weight_gets_no_gradient():
    x = torch.randn(4, 32, requires_grad=True)
    weight = torch.ones(32)
    kernels.rms_norm(x, weight, EPS).sum().backward()
    assert weight.grad is None and torch.isfinite(x.grad).all()


def test_no_rows():
    x = torch.randn(0, 8, requires_grad=True)
    weight = torch.ones(8, requires_grad=True)
    y = kernels.rms_norm(x, weight, EPS)
    y.sum().backward()
    assert y.shape == (0, 8) and x.grad.shape == (0, 8) and torch.equal(weight.grad, torch.zeros(8))
