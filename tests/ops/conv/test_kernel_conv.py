"""The causal conv kernel (runtime/ops/conv/kernel.py) under TRITON_INTERPRET=1 vs the fp64 reference:
forward and the gradients of x, weight and bias, with and without silu, T not a multiple of the time
block and C not a multiple of the channel block, a sequence shorter than the kernel; NaN-prefilled buffers.

Shape legend: B batch, T tokens, C channels, W kernel width. fp32 inputs (the interpreter's reach).
"""
import pytest
import torch

from reference_ops import conv as ref
from runtime.ops.conv import kernel as kernels
from tests.opcheck import check_op

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("nan_buffers")]

# (B, T, C, W): T=63 spans two 32-row blocks, the last partial; C=130 two channel blocks, the last partial
SHAPES = {"B2-T63-C130-W4": (2, 63, 130, 4), "B1-T2-C5-W4-shorter-than-kernel": (1, 2, 5, 4),
          "B1-T40-C7-W3": (1, 40, 7, 3)}


@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "no-act"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_reference(shape, with_bias, activation):
    torch.manual_seed(0)
    batch, num_tokens, num_channels, width = SHAPES[shape]
    inputs = {"x_BTC": torch.randn(batch, num_tokens, num_channels), "weight_CW": torch.randn(num_channels, width) * 0.5}
    if with_bias:
        inputs["bias_C"] = torch.randn(num_channels) * 0.5
    check_op("causal_conv1d", kernels.causal_conv1d, ref.causal_conv1d, inputs, torch.float32, activation=activation)
