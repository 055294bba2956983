"""Norms: runtime forms vs the fp64 reference (forward and every gradient), and the reference vs
transformers' own norm classes (Qwen3-MoE, Qwen3-Next "1+w", Qwen3-Next gated, nn.LayerNorm)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, Qwen3NextRMSNormGated

from reference_ops import norms as ref
from runtime.ops.norm import torch_form as run
from runtime.tolerances import assert_close
from tests.opcheck import check_op

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
SHAPES = [
    pytest.param((2, 63, 96), id="B2-T63-D96"),
    pytest.param((1, 1, 7), id="B1-T1-D7"),
    pytest.param((3, 5, 256), id="B3-T5-D256"),
]
EPS = 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["w", "1+w"])
def test_rms_norm_matches_reference(shape, dtype, offset):
    torch.manual_seed(0)
    inputs = {"x": torch.randn(shape) * 3, "weight": torch.randn(shape[-1]) * 0.5 + (1 - offset)}
    check_op("rms_norm", run.rms_norm, ref.rms_norm, inputs, dtype, eps=EPS, offset=offset)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_rms_norm_matches_reference(shape, dtype):
    torch.manual_seed(1)
    inputs = {"x": torch.randn(shape), "gate": torch.randn(shape) * 2, "weight": torch.randn(shape[-1]) * 0.5 + 1}
    check_op("gated_rms_norm", run.gated_rms_norm, ref.gated_rms_norm, inputs, dtype, eps=EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_matches_reference(shape, dtype):
    torch.manual_seed(2)
    inputs = {"x": torch.randn(shape) + 2, "weight": torch.randn(shape[-1]) * 0.5 + 1, "bias": torch.randn(shape[-1])}
    check_op("layer_norm", run.layer_norm, ref.layer_norm, inputs, dtype, eps=1e-5)


def _fp32_inside(module_output: torch.Tensor, expected: torch.Tensor, op: str):
    """transformers' norms upcast to fp32 whatever the input dtype, so fp32 accuracy is the bar."""
    assert_close(module_output, expected, op, torch.float32, "out", "vs transformers")


def test_rms_norm_reference_equals_qwen3_moe():
    torch.manual_seed(3)
    module = Qwen3MoeRMSNorm(48, eps=1e-6).double()
    torch.nn.init.normal_(module.weight, 1.0, 0.3)
    x = torch.randn(2, 9, 48, dtype=torch.float64)
    _fp32_inside(module(x), ref.rms_norm(x, module.weight, 1e-6), "rms_norm")


def test_rms_norm_one_plus_w_reference_equals_qwen3_next():
    torch.manual_seed(4)
    module = Qwen3NextRMSNorm(48, eps=1e-6).double()
    torch.nn.init.normal_(module.weight, 0.0, 0.3)
    x = torch.randn(2, 9, 48, dtype=torch.float64)
    _fp32_inside(module(x), ref.rms_norm(x, module.weight, 1e-6, offset=1.0), "rms_norm")


def test_gated_rms_norm_reference_equals_qwen3_next():
    torch.manual_seed(5)
    module = Qwen3NextRMSNormGated(32, eps=1e-6).double()
    torch.nn.init.normal_(module.weight, 1.0, 0.3)
    x, gate = torch.randn(4, 7, 32, dtype=torch.float64), torch.randn(4, 7, 32, dtype=torch.float64)
    _fp32_inside(module(x, gate), ref.gated_rms_norm(x, gate, module.weight, 1e-6), "gated_rms_norm")


def test_layer_norm_reference_equals_torch_layer_norm():
    torch.manual_seed(6)
    module = torch.nn.LayerNorm(40, eps=1e-5, dtype=torch.float64)
    torch.nn.init.normal_(module.weight, 1.0, 0.3)
    torch.nn.init.normal_(module.bias, 0.0, 0.3)
    x = torch.randn(3, 11, 40, dtype=torch.float64)
    assert_close(ref.layer_norm(x, module.weight, module.bias, 1e-5), module(x), "layer_norm", torch.float64)


def test_runtime_rms_norm_keeps_input_dtype():
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    assert run.rms_norm(x, torch.ones(8), 1e-6).dtype == torch.bfloat16
