"""RoPE: runtime tables and rotation vs the fp64 reference (forward and input gradient), and the
reference vs transformers' rotary classes and apply functions (Llama-style scalings, DeepSeek-V3 yarn,
GLM4-MoE / Qwen3-Next partial rotary, DeepSeek / GLM interleaved pairs, Qwen2-VL / Qwen3.5 mrope)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, Glm4MoeConfig, LlamaConfig, Qwen3NextConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek
from transformers.models.glm import modeling_glm as hf_glm
from transformers.models.glm4_moe import modeling_glm4_moe as hf_glm4_moe
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next

from reference_ops import rope as ref
from runtime.ops.rope import torch_form as run
from runtime.tolerances import assert_close

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]

# DeepSeek-V3's yarn settings (mscale equal to mscale_all_dim), at a short original length
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "original_max_position_embeddings": 64,
}
SCALINGS = [
    pytest.param(None, id="default"),
    pytest.param({"rope_type": "dynamic", "factor": 2.0}, id="dynamic"),
    pytest.param({"rope_type": "linear", "factor": 4.0}, id="linear"),
    pytest.param(
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        id="llama3",
    ),
    pytest.param({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, id="yarn"),
    pytest.param(
        DEEPSEEK_YARN,
        id="yarn-deepseek",
    ),
    pytest.param(
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "attention_factor": 0.9,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
        id="yarn-explicit-factor",
    ),
]
# (K head dim, R rotary dim)
ROTARY = [
    pytest.param((16, 16), id="K16-R16"),
    pytest.param((24, 12), id="K24-R12-partial-half"),
    pytest.param((64, 16), id="K64-R16-partial-quarter"),
]


def _positions(batch: int, num_tokens: int) -> torch.Tensor:
    """Distinct per-row offsets (as with packing or a cache) below 512, where fp32 angles stay accurate."""
    return torch.arange(num_tokens)[None, :] + torch.tensor([0, 37, 311][:batch])[:, None]


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("rotary_dim", [16, 64])
def test_inv_freq_matches_reference(scaling, rotary_dim):
    run_freq, run_factor = run.rope_inv_freq(rotary_dim, 10000.0, scaling)
    ref_freq, ref_factor = ref.rope_inv_freq(rotary_dim, 10000.0, scaling)
    assert run_freq.dtype == torch.float32
    assert_close(run_freq, ref_freq, "rope_inv_freq", torch.float32)
    assert run_factor == pytest.approx(ref_factor, rel=1e-12)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_inv_freq_reference_equals_transformers(scaling):
    params = {"rope_type": "default", "rope_theta": 10000.0, **(scaling or {})}
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256, rope_parameters=params
    )
    init_fn = ROPE_INIT_FUNCTIONS.get(
        params["rope_type"], hf_qwen3_next.Qwen3NextRotaryEmbedding.compute_default_rope_parameters
    )
    hf_freq, hf_factor = init_fn(config)
    ref_freq, ref_factor = ref.rope_inv_freq(16, 10000.0, scaling)
    # transformers builds its tables in fp32
    assert_close(hf_freq, ref_freq, "rope_inv_freq", torch.float32, name="vs transformers")
    assert hf_factor == pytest.approx(ref_factor, rel=1e-12)


def test_yarn_without_factor_is_rejected():
    with pytest.raises(ValueError, match="factor"):
        ref.rope_inv_freq(16, 10000.0, {"rope_type": "yarn", "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match="factor"):
        run.rope_inv_freq(16, 10000.0, {"rope_type": "yarn", "original_max_position_embeddings": 64})


@pytest.mark.parametrize("attention_factor", [1.0, 1.3])
def test_cos_sin_match_reference(attention_factor):
    inv_freq, _ = ref.rope_inv_freq(24, 10000.0, None)
    positions_BT = _positions(3, 63)
    run_cos, run_sin = run.rope_cos_sin(positions_BT, inv_freq.float(), attention_factor)
    ref_cos, ref_sin = ref.rope_cos_sin(positions_BT, inv_freq, attention_factor)
    assert run_cos.shape == (3, 63, 24) and run_cos.dtype == torch.float32
    assert_close(run_cos, ref_cos, "rope_cos_sin", torch.float32, name="cos")
    assert_close(run_sin, ref_sin, "rope_cos_sin", torch.float32, name="sin")


@pytest.mark.parametrize("interleaved", [False, True], ids=["contiguous", "interleaved"])
@pytest.mark.parametrize("section", [[2, 2, 2], [3, 2, 1], [4, 1, 1]], ids=lambda s: "sec" + "-".join(map(str, s)))
def test_mrope_cos_sin_match_reference(section, interleaved):
    torch.manual_seed(0)
    inv_freq, _ = ref.rope_inv_freq(12, 10000.0, None)
    positions_3BT = torch.randint(0, 300, (3, 2, 17))
    run_cos, run_sin = run.mrope_cos_sin(positions_3BT, inv_freq.float(), section, interleaved, 1.0)
    ref_cos, ref_sin = ref.mrope_cos_sin(positions_3BT, inv_freq, section, interleaved, 1.0)
    assert_close(run_cos, ref_cos, "mrope_cos_sin", torch.float32, name="cos")
    assert_close(run_sin, ref_sin, "mrope_cos_sin", torch.float32, name="sin")


def test_mrope_section_must_cover_all_frequencies():
    with pytest.raises(ValueError, match="mrope_section"):
        ref.mrope_cos_sin(torch.zeros(3, 1, 4), torch.ones(6), [2, 2, 1], True)
    with pytest.raises(ValueError, match="mrope_section"):
        run.mrope_cos_sin(torch.zeros(3, 1, 4), torch.ones(6), [2, 2, 1], True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("dims", ROTARY)
@pytest.mark.parametrize(
    "batch,num_tokens,num_heads", [(2, 63, 3), (1, 1, 1), (3, 8, 4)], ids=["B2-T63-H3", "B1-T1-H1", "B3-T8-H4"]
)
def test_apply_rope_matches_reference(batch, num_tokens, num_heads, dims, interleaved, dtype):
    torch.manual_seed(1)
    head_dim, rotary_dim = dims
    inv_freq, factor = ref.rope_inv_freq(
        rotary_dim, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    )
    cos_BTR, sin_BTR = ref.rope_cos_sin(_positions(batch, num_tokens), inv_freq, factor)
    x_run = torch.randn(batch, num_tokens, num_heads, head_dim).to(dtype).requires_grad_()
    x_ref = x_run.detach().double().requires_grad_()
    y_run = run.apply_rope(x_run, cos_BTR.float(), sin_BTR.float(), interleaved)
    y_ref = ref.apply_rope(x_ref, cos_BTR, sin_BTR, interleaved)
    assert y_run.dtype == dtype
    assert_close(y_run, y_ref, "apply_rope", dtype, "out")
    cotangent = torch.randn_like(y_ref)
    y_run.backward(cotangent.to(dtype))
    y_ref.backward(cotangent)
    assert_close(x_run.grad, x_ref.grad, "apply_rope", dtype, "grad", "x")


def _hf_cos_sin(rotary_module, positions_BT, dtype=torch.float64):
    return rotary_module(torch.zeros(1, dtype=dtype), positions_BT)


def _q_k(head_dim: int, seed: int):
    """q, k in transformers' [B, H, T, K] layout, fp64."""
    torch.manual_seed(seed)
    return torch.randn(2, 3, 11, head_dim, dtype=torch.float64), torch.randn(2, 2, 11, head_dim, dtype=torch.float64)


def _ours(x_BHTK, cos_BTR, sin_BTR, interleaved):
    return ref.apply_rope(x_BHTK.transpose(1, 2), cos_BTR, sin_BTR, interleaved).transpose(1, 2)


def test_deepseek_v3_yarn_tables_and_rotation_equal_transformers():
    scaling = dict(DEEPSEEK_YARN)
    config = DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=4,
        qk_rope_head_dim=8,
        max_position_embeddings=2560,
        rope_parameters={"rope_theta": 10000.0, **scaling},
    )
    rotary = hf_deepseek.DeepseekV3RotaryEmbedding(config)
    inv_freq, factor = ref.rope_inv_freq(8, 10000.0, scaling)
    assert_close(rotary.inv_freq, inv_freq, "rope_inv_freq", torch.float32, name="vs transformers")
    assert rotary.attention_scaling == pytest.approx(factor, rel=1e-12)
    positions_BT = _positions(2, 11)
    hf_cos, hf_sin = _hf_cos_sin(rotary, positions_BT)
    assert_close(
        hf_cos,
        ref.rope_cos_sin(positions_BT, inv_freq, factor)[0],
        "rope_cos_sin",
        torch.float32,
        name="vs transformers",
    )
    q, k = _q_k(8, 2)
    hf_q, hf_k = hf_deepseek.apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    assert_close(_ours(q, hf_cos, hf_sin, False), hf_q, "apply_rope", torch.float64)
    assert_close(_ours(k, hf_cos, hf_sin, False), hf_k, "apply_rope", torch.float64)


def _deinterleave(x_BHTK: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """DeepSeek's interleaved apply writes pair (2i, 2i+1) to channels (i, i + R/2); same dot products."""
    rot = x_BHTK[..., :rotary_dim]
    return torch.cat([rot[..., 0::2], rot[..., 1::2], x_BHTK[..., rotary_dim:]], dim=-1)


def test_interleaved_rope_equals_deepseek_up_to_its_output_layout():
    inv_freq, _ = ref.rope_inv_freq(8, 10000.0, None)
    positions_BT = _positions(2, 11)
    cos_BTR, sin_BTR = ref.rope_cos_sin(positions_BT, inv_freq)
    q, k = _q_k(8, 3)
    hf_q, hf_k = hf_deepseek.apply_rotary_pos_emb_interleave(q, k, cos_BTR, sin_BTR)
    assert_close(_deinterleave(_ours(q, cos_BTR, sin_BTR, True), 8), hf_q, "apply_rope", torch.float64)
    assert_close(_deinterleave(_ours(k, cos_BTR, sin_BTR, True), 8), hf_k, "apply_rope", torch.float64)


def test_interleaved_partial_rope_equals_glm():
    inv_freq, _ = ref.rope_inv_freq(8, 10000.0, None)
    cos_BTR, sin_BTR = ref.rope_cos_sin(_positions(2, 11), inv_freq)
    q, k = _q_k(16, 4)
    hf_q, hf_k = hf_glm.apply_rotary_pos_emb(q, k, cos_BTR, sin_BTR)
    assert_close(_ours(q, cos_BTR, sin_BTR, True), hf_q, "apply_rope", torch.float64)
    assert_close(_ours(k, cos_BTR, sin_BTR, True), hf_k, "apply_rope", torch.float64)


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(
            (Glm4MoeConfig, hf_glm4_moe.Glm4MoeRotaryEmbedding, hf_glm4_moe.apply_rotary_pos_emb, 0.5),
            id="glm4-moe-half",
        ),
        pytest.param(
            (Qwen3NextConfig, hf_qwen3_next.Qwen3NextRotaryEmbedding, hf_qwen3_next.apply_rotary_pos_emb, 0.25),
            id="qwen3-next-quarter",
        ),
    ],
)
def test_partial_rotary_equals_transformers(family):
    config_cls, rotary_cls, apply_fn, fraction = family
    config = config_cls(hidden_size=64, num_attention_heads=4, head_dim=32, partial_rotary_factor=fraction)
    rotary = rotary_cls(config)
    rotary_dim = int(32 * fraction)
    inv_freq, factor = ref.rope_inv_freq(rotary_dim, config.rope_parameters["rope_theta"], None)
    assert_close(rotary.inv_freq, inv_freq, "rope_inv_freq", torch.float32, name="vs transformers")
    hf_cos, hf_sin = _hf_cos_sin(rotary, _positions(2, 11))
    assert hf_cos.shape[-1] == rotary_dim
    q, k = _q_k(32, 5)
    hf_q, hf_k = apply_fn(q, k, hf_cos, hf_sin)
    assert_close(_ours(q, hf_cos, hf_sin, False), hf_q, "apply_rope", torch.float64)
    assert_close(_ours(k, hf_cos, hf_sin, False), hf_k, "apply_rope", torch.float64)


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(
            (Qwen3_5MoeTextConfig, Qwen3_5MoeTextRotaryEmbedding, True, 0.25), id="qwen3.5-moe-interleaved-quarter"
        ),
        pytest.param((Qwen2VLTextConfig, Qwen2VLRotaryEmbedding, False, 1.0), id="qwen2-vl-contiguous"),
    ],
)
def test_mrope_tables_equal_transformers(family):
    config_cls, rotary_cls, interleaved, fraction = family
    head_dim = int(12 / fraction)
    params = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 2, 2],
        "partial_rotary_factor": fraction,
    }
    config = config_cls(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_parameters=params)
    rotary = rotary_cls(config)
    torch.manual_seed(6)
    positions_3BT = torch.randint(0, 300, (3, 2, 13))
    hf_cos, hf_sin = _hf_cos_sin(rotary, positions_3BT)
    inv_freq, _ = ref.rope_inv_freq(12, 10000.0, None)
    ref_cos, ref_sin = ref.mrope_cos_sin(positions_3BT, inv_freq, [2, 2, 2], interleaved)
    assert_close(hf_cos, ref_cos, "mrope_cos_sin", torch.float32, name="cos vs transformers")
    assert_close(hf_sin, ref_sin, "mrope_cos_sin", torch.float32, name="sin vs transformers")
