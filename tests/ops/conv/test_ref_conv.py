"""Short causal conv: runtime (torch conv1d) vs the fp64 reference, forward and gradients of x, weight
and bias; the reference vs Qwen3-Next's torch causal conv (its path without the causal-conv1d package)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

from reference_ops import conv as ref
from runtime.ops.conv import torch_form as run
from runtime.tolerances import assert_close
from tests.opcheck import check_op

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# (B, T, C, W)
SHAPES = [
    pytest.param((2, 63, 48, 4), id="B2-T63-C48-W4"),
    pytest.param((1, 2, 5, 4), id="B1-T2-C5-W4-shorter-than-kernel"),
    pytest.param((3, 17, 7, 3), id="B3-T17-C7-W3"),
    pytest.param((1, 9, 6, 1), id="B1-T9-C6-W1"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "no-act"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", SHAPES)
def test_causal_conv1d_matches_reference(shape, with_bias, activation, dtype):
    torch.manual_seed(0)
    batch, num_tokens, num_channels, width = shape
    inputs = {
        "x_BTC": torch.randn(batch, num_tokens, num_channels),
        "weight_CW": torch.randn(num_channels, width) * 0.5,
    }
    if with_bias:
        inputs["bias_C"] = torch.randn(num_channels) * 0.5
    check_op("causal_conv1d", run.causal_conv1d, ref.causal_conv1d, inputs, dtype, activation=activation)


def test_causal_conv1d_is_causal():
    torch.manual_seed(1)
    x_BTC, weight_CW = torch.randn(1, 12, 3, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    changed_BTC = x_BTC.clone()
    changed_BTC[:, 7:] += 1.0
    for op in (ref.causal_conv1d, run.causal_conv1d):
        assert torch.equal(op(x_BTC, weight_CW)[:, :7], op(changed_BTC, weight_CW)[:, :7])


@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "no-act"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_reference_equals_qwen3_next_torch_conv(with_bias, activation):
    torch.manual_seed(2)
    x_BTC, weight_CW = torch.randn(2, 23, 10, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
    bias_C = torch.randn(10, dtype=torch.float64) if with_bias else None
    # transformers works channels-first: [B, C, T]
    hf_BCT = causal_conv1d_fn(x_BTC.transpose(1, 2), weight_CW, bias_C, activation=activation)
    assert_close(
        ref.causal_conv1d(x_BTC, weight_CW, bias_C, activation), hf_BCT.transpose(1, 2), "causal_conv1d", torch.float64
    )


def test_unknown_activation_is_rejected():
    x_BTC, weight_CW = torch.randn(1, 3, 2), torch.randn(2, 4)
    for op in (ref.causal_conv1d, run.causal_conv1d):
        with pytest.raises(ValueError, match="gelu"):
            op(x_BTC, weight_CW, None, "gelu")
