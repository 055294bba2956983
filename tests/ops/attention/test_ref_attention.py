"""Softmax attention: runtime (SDPA / explicit fp32 with sinks) vs the fp64 reference, forward and
gradients of q, k, v and sinks; the reference vs transformers' eager attention (gpt-oss with sinks,
Qwen3-MoE without) and vs transformers' sliding-window mask convention."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen3_moe

from reference_ops import attention as ref
from runtime.ops.attention import torch_form as run
from runtime.tolerances import assert_close
from tests.opcheck import check_op

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# (B, T, H, G, K, V)
SHAPES = [
    pytest.param((2, 63, 4, 2, 16, 16), id="B2-T63-H4-G2-K16"),
    pytest.param((1, 1, 2, 2, 8, 8), id="B1-T1-H2-G2-K8"),
    pytest.param((2, 17, 6, 1, 24, 12), id="B2-T17-H6-G1-K24-V12"),
]
VARIANTS = [
    pytest.param({}, id="causal"),
    pytest.param({"causal": False}, id="bidirectional"),
    pytest.param({"window": 7}, id="window7"),
    pytest.param({"window": 1}, id="window1"),
    pytest.param({"sinks": True}, id="sinks"),
    pytest.param({"sinks": True, "window": 5}, id="sinks-window5"),
]


def _inputs(shape, with_sinks: bool, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    batch, num_tokens, num_heads, num_kv_heads, key_dim, value_dim = shape
    inputs = {
        "q_BTHK": torch.randn(batch, num_tokens, num_heads, key_dim),
        "k_BTGK": torch.randn(batch, num_tokens, num_kv_heads, key_dim),
        "v_BTGV": torch.randn(batch, num_tokens, num_kv_heads, value_dim),
    }
    if with_sinks:
        inputs["sinks_H"] = torch.randn(num_heads) + 1.0
    return inputs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_softmax_attention_matches_reference(shape, variant, dtype):
    variant = dict(variant)
    inputs = _inputs(shape, variant.pop("sinks", False))
    check_op(
        "softmax_attention",
        run.softmax_attention,
        ref.softmax_attention,
        inputs,
        dtype,
        scale=shape[4] ** -0.5,
        **variant,
    )


@pytest.mark.parametrize("window", [None, 1, 4, 100])
def test_visible_mask_follows_transformers(window):
    q_idx, kv_idx = torch.arange(9)[:, None], torch.arange(9)[None, :]
    mask_fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    expected_TT = mask_fn(0, 0, q_idx, kv_idx).expand(9, 9)
    assert torch.equal(run.visible_mask(9, True, window, torch.device("cpu")), expected_TT)
    assert torch.equal(ref.visible_mask(9, True, window, torch.device("cpu")), expected_TT)


def _additive_mask(num_tokens: int, window: int | None) -> torch.Tensor:
    visible_TT = ref.visible_mask(num_tokens, True, window, torch.device("cpu"))
    return torch.zeros(num_tokens, num_tokens, dtype=torch.float64).masked_fill(
        ~visible_TT, torch.finfo(torch.float64).min
    )[None, None]


@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window5"])
def test_reference_with_sinks_equals_gpt_oss_eager(window):
    shape = (2, 19, 4, 2, 16, 16)
    inputs = {name: t.double() for name, t in _inputs(shape, with_sinks=True, seed=1).items()}
    module = types.SimpleNamespace(num_key_value_groups=2, sinks=inputs["sinks_H"], training=False)
    q, k, v = (inputs[n].transpose(1, 2) for n in ("q_BTHK", "k_BTGK", "v_BTGV"))
    hf_out, _ = hf_gpt_oss.eager_attention_forward(module, q, k, v, _additive_mask(19, window), scaling=0.25)
    ours = ref.softmax_attention(**inputs, scale=0.25, causal=True, window=window)
    assert_close(ours, hf_out, "softmax_attention", torch.float64, name="vs gpt-oss eager")


def test_reference_without_sinks_equals_qwen3_moe_eager():
    inputs = {name: t.double() for name, t in _inputs((2, 23, 6, 2, 16, 16), with_sinks=False, seed=2).items()}
    module = types.SimpleNamespace(num_key_value_groups=3, training=False)
    q, k, v = (inputs[n].transpose(1, 2) for n in ("q_BTHK", "k_BTGK", "v_BTGV"))
    hf_out, _ = hf_qwen3_moe.eager_attention_forward(module, q, k, v, _additive_mask(23, None), scaling=0.25)
    # transformers' eager softmax runs in fp32 whatever the input dtype
    assert_close(
        hf_out,
        ref.softmax_attention(**inputs, scale=0.25),
        "softmax_attention",
        torch.float32,
        name="vs qwen3-moe eager",
    )
