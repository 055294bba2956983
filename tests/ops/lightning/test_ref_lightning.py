"""Lightning attention: runtime chunked form vs the fp64 token-by-token reference, outputs, final
state and gradients of q, k, v and the initial state; a whole MiniMax lightning block built on the
reference op vs transformers' MiniMaxLightningAttention with the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import MiniMaxConfig
from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

from reference_ops import lightning as ref
from reference_ops.norms import rms_norm
from runtime.ops.lightning import torch_form as run
from runtime.tolerances import assert_close
from tests.opcheck import check_op

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# (B, T, H, K, V); the runtime chunk is 64 tokens
SHAPES = [
    pytest.param((2, 63, 3, 16, 8), id="B2-T63-H3-K16-V8"),
    pytest.param((1, 130, 2, 8, 12), id="B1-T130-H2-K8-V12-three-chunks"),
    pytest.param((2, 64, 2, 8, 8), id="B2-T64-one-full-chunk"),
    pytest.param((1, 1, 2, 4, 4), id="B1-T1"),
]
SLOPES = {
    # MiniMax's own schedule for 8 heads, first layer: 2^(-8/H * (h+1))
    "minimax": lambda num_heads: 2.0 ** (-8.0 / 8 * (torch.arange(num_heads) + 1.0)),
    "fast-decay": lambda num_heads: torch.full((num_heads,), 3.0),
    "long-memory": lambda num_heads: torch.full((num_heads,), 1e-4),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_initial_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("slopes", list(SLOPES), ids=list(SLOPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_lightning_matches_reference(shape, slopes, with_initial_state, dtype):
    torch.manual_seed(0)
    batch, num_tokens, num_heads, key_dim, value_dim = shape
    inputs = {
        # MiniMax feeds silu activations, mostly positive and O(1)
        "q_BTHK": F.silu(torch.randn(batch, num_tokens, num_heads, key_dim)) * key_dim**-0.5,
        "k_BTHK": F.silu(torch.randn(batch, num_tokens, num_heads, key_dim)) * key_dim**-0.5,
        "v_BTHV": torch.randn(batch, num_tokens, num_heads, value_dim),
    }
    if with_initial_state:
        inputs["initial_state_BHKV"] = torch.randn(batch, num_heads, key_dim, value_dim)
    check_op(
        "lightning_attention",
        run.lightning_attention,
        ref.lightning_attention,
        inputs,
        dtype,
        slope_H=SLOPES[slopes](num_heads),
    )


def test_runtime_state_and_output_dtypes():
    q = torch.randn(1, 5, 2, 4, dtype=torch.bfloat16)
    o, state = run.lightning_attention(q, q, q, torch.full((2,), 0.1))
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32


def _minimax_module(layer_idx: int) -> MiniMaxLightningAttention:
    config = MiniMaxConfig(
        hidden_size=32,
        num_attention_heads=2,
        head_dim=16,
        num_hidden_layers=4,
        block_size=16,
        layer_types=["linear_attention"] * 4,
    )
    torch.manual_seed(3)
    module = MiniMaxLightningAttention(config, layer_idx).double().eval()
    torch.nn.init.normal_(module.norm.weight, 1.0, 0.2)
    return module


def _block_with_reference_op(
    module: MiniMaxLightningAttention, x_BTD: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_BTD, final_state_BHKV) of the MiniMax lightning layer written around our op:
    silu(qkv), recurrence, norm, sigmoid gate, out proj."""
    batch, num_tokens, _ = x_BTD.shape
    qkv_BTHX = F.silu(x_BTD @ module.qkv_proj.weight.T).view(batch, num_tokens, module.num_attention_heads, -1)
    q_BTHK, k_BTHK, v_BTHV = qkv_BTHX.split(module.head_dim, dim=-1)
    o_BTHV, state_BHKV = ref.lightning_attention(q_BTHK, k_BTHK, v_BTHV, module.slope_rate.flatten())
    # MiniMax builds this norm with the RMSNorm default eps, not config.rms_norm_eps
    o_BTX = rms_norm(o_BTHV.reshape(batch, num_tokens, -1), module.norm.weight, 1e-6)
    o_BTX = torch.sigmoid(x_BTD @ module.output_gate.weight.T) * o_BTX
    return o_BTX @ module.out_proj.weight.T, state_BHKV


@pytest.mark.parametrize("num_tokens", [40, 16, 7], ids=["T40-partial-block", "T16-one-block", "T7"])
@pytest.mark.parametrize("layer_idx", [0, 2])
def test_block_on_reference_op_equals_minimax(layer_idx, num_tokens):
    module = _minimax_module(layer_idx)
    x_BTD = torch.randn(2, num_tokens, 32, dtype=torch.float64)
    hf_out, hf_state = module(x_BTD, position_embeddings=None, attention_mask=None)
    ours, state_BHKV = _block_with_reference_op(module, x_BTD)
    # MiniMax's norm upcasts to fp32 and its decay tables are built in fp32
    assert_close(ours, hf_out, "lightning_attention", torch.float32, name="block vs MiniMaxLightningAttention")
    assert_close(state_BHKV, hf_state, "lightning_attention", torch.float32, name="state vs MiniMaxLightningAttention")
