"""MLA: runtime (expanded latents + SDPA) vs the fp64 reference, forward and gradients of x and every
weight; the reference vs transformers' DeepseekV3Attention with the same weights (whole block output),
with yarn scaling, interleaved and plain rope, with and without the q low-rank path."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from reference_ops import mla as ref
from reference_ops.rope import rope_cos_sin, rope_inv_freq
from runtime.ops.mla import torch_form as run
from runtime.tolerances import assert_close

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "original_max_position_embeddings": 32,
}
# DeepSeek-V3 builds its latent norms with the RMSNorm default eps, not config.rms_norm_eps
LATENT_EPS = 1e-6


def _dims(q_lora_rank: int | None, interleaved: bool) -> dict:
    return {
        "num_heads": 4,
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 6,
        "v_head_dim": 12,
        "interleaved_rope": interleaved,
    }


def _random_params(dims: dict, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    heads, qk_head_dim = dims["num_heads"], dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]
    shapes = {
        "kv_a_proj_with_mqa": (dims["kv_lora_rank"] + dims["qk_rope_head_dim"], hidden),
        "kv_a_layernorm": (dims["kv_lora_rank"],),
        "kv_b_proj": (heads * (dims["qk_nope_head_dim"] + dims["v_head_dim"]), dims["kv_lora_rank"]),
        "o_proj": (hidden, heads * dims["v_head_dim"]),
    }
    if dims["q_lora_rank"] is None:
        shapes["q_proj"] = (heads * qk_head_dim, hidden)
    else:
        shapes.update(
            q_a_proj=(dims["q_lora_rank"], hidden),
            q_a_layernorm=(dims["q_lora_rank"],),
            q_b_proj=(heads * qk_head_dim, dims["q_lora_rank"]),
        )
    return {name: _init(shape) for name, shape in shapes.items()}


def _init(shape: tuple[int, ...]) -> torch.Tensor:
    if len(shape) == 1:
        return 1.0 + 0.2 * torch.randn(shape)
    return torch.randn(shape) * shape[1] ** -0.5


def _rope_tables(batch: int, num_tokens: int, rope_dim: int):
    inv_freq, factor = rope_inv_freq(rope_dim, 10000.0, YARN)
    positions_BT = torch.arange(num_tokens)[None, :] + 5 * torch.arange(batch)[:, None]
    return rope_cos_sin(positions_BT, inv_freq, factor)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q-lora24", "q-full"])
@pytest.mark.parametrize("batch,num_tokens", [(2, 63), (1, 1)], ids=["B2-T63", "B1-T1"])
def test_mla_matches_reference(batch, num_tokens, q_lora_rank, interleaved, dtype):
    hidden, dims = 40, _dims(q_lora_rank, interleaved)
    params = _random_params(dims, hidden, seed=0)
    cos_BTR, sin_BTR = _rope_tables(batch, num_tokens, dims["qk_rope_head_dim"])
    scale = run.mla_softmax_scale(dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"], YARN)
    x_run = torch.randn(batch, num_tokens, hidden).to(dtype).requires_grad_()
    params_run = {name: w.to(dtype).requires_grad_() for name, w in params.items()}
    x_ref = x_run.detach().double().requires_grad_()
    params_ref = {name: w.detach().double().requires_grad_() for name, w in params_run.items()}
    static = dict(dims, scale=scale, eps=LATENT_EPS)
    out_run = run.mla_attention(x_run, params_run, cos_BTR=cos_BTR.float(), sin_BTR=sin_BTR.float(), **static)
    out_ref = ref.mla_attention(x_ref, params_ref, cos_BTR=cos_BTR, sin_BTR=sin_BTR, **static)
    assert out_run.dtype == dtype
    assert_close(out_run, out_ref, "mla_attention", dtype, "out")
    cotangent = torch.randn_like(out_ref)
    out_run.backward(cotangent.to(dtype))
    out_ref.backward(cotangent)
    assert_close(x_run.grad, x_ref.grad, "mla_attention", dtype, "grad", "x")
    for name in params:
        assert_close(params_run[name].grad, params_ref[name].grad, "mla_attention", dtype, "grad", name)


def _deepseek_module(dims: dict, hidden: int, params: dict) -> tuple[DeepseekV3Attention, DeepseekV3Config]:
    config = DeepseekV3Config(
        hidden_size=hidden,
        num_attention_heads=dims["num_heads"],
        num_key_value_heads=dims["num_heads"],
        q_lora_rank=dims["q_lora_rank"],
        kv_lora_rank=dims["kv_lora_rank"],
        qk_nope_head_dim=dims["qk_nope_head_dim"],
        qk_rope_head_dim=dims["qk_rope_head_dim"],
        v_head_dim=dims["v_head_dim"],
        rope_interleave=dims["interleaved_rope"],
        max_position_embeddings=1280,
        rope_parameters={"rope_theta": 10000.0, **YARN},
        attn_implementation="eager",
    )
    module = DeepseekV3Attention(config, layer_idx=0).double().eval()
    for name, weight in params.items():
        getattr(module, name).weight.data.copy_(weight)
    return module, config


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q-lora24", "q-full"])
def test_mla_reference_equals_deepseek_v3_attention(q_lora_rank, interleaved):
    hidden, dims, num_tokens = 40, _dims(q_lora_rank, interleaved), 21
    params = {name: w.double() for name, w in _random_params(dims, hidden, seed=1).items()}
    module, config = _deepseek_module(dims, hidden, params)
    qk_head_dim = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]
    assert run.mla_softmax_scale(qk_head_dim, config.rope_parameters) == pytest.approx(module.scaling, rel=1e-12)
    x_BTD = torch.randn(2, num_tokens, hidden, dtype=torch.float64)
    positions_BT = torch.arange(num_tokens)[None, :].expand(2, -1)
    cos_BTR, sin_BTR = DeepseekV3RotaryEmbedding(config)(x_BTD, positions_BT)
    causal = torch.full((num_tokens, num_tokens), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[
        None, None
    ]
    hf_out, _ = module(x_BTD, (cos_BTR, sin_BTR), causal)
    ours = ref.mla_attention(
        x_BTD, params, cos_BTR=cos_BTR, sin_BTR=sin_BTR, scale=module.scaling, eps=LATENT_EPS, **dims
    )
    # DeepseekV3RMSNorm computes in fp32 even for fp64 inputs, so the block agrees to fp32 accuracy
    assert_close(ours, hf_out, "mla_attention", torch.float32, name="vs DeepseekV3Attention")


def test_softmax_scale_without_scaling_is_plain():
    assert run.mla_softmax_scale(192, None) == pytest.approx(192**-0.5)
    assert run.mla_softmax_scale(192, {"rope_type": "yarn", "factor": 40.0}) == pytest.approx(192**-0.5)


def _nope_tables(batch: int, num_tokens: int, rope_dim: int):
    """NoPE MLA (Kimi): the rope part used unrotated, i.e. cos 1 and sin 0."""
    return torch.ones(batch, num_tokens, rope_dim, dtype=torch.float64), torch.zeros(batch, num_tokens, rope_dim,
                                                                                    dtype=torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_nope_mla_matches_reference(dtype):
    """Kimi K3's MLA: no positions, and the heads' output times sigmoid(g_proj(x)) before o_proj; forward and the
    gradients of x and every weight, g_proj's included."""
    hidden, dims, batch, num_tokens = 40, _dims(24, False), 2, 63
    params = _random_params(dims, hidden, seed=3) | {"g_proj": _init((dims["num_heads"] * dims["v_head_dim"], hidden))}
    cos_BTR, sin_BTR = _nope_tables(batch, num_tokens, dims["qk_rope_head_dim"])
    x_run = torch.randn(batch, num_tokens, hidden).to(dtype).requires_grad_()
    params_run = {name: w.to(dtype).requires_grad_() for name, w in params.items()}
    x_ref = x_run.detach().double().requires_grad_()
    params_ref = {name: w.detach().double().requires_grad_() for name, w in params_run.items()}
    static = dict(dims, scale=(dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5, eps=LATENT_EPS)
    out_run = run.mla_attention(x_run, params_run, cos_BTR=cos_BTR.float(), sin_BTR=sin_BTR.float(), **static)
    out_ref = ref.mla_attention(x_ref, params_ref, cos_BTR=cos_BTR, sin_BTR=sin_BTR, **static)
    assert_close(out_run, out_ref, "mla_attention", dtype, "out")
    cotangent = torch.randn_like(out_ref)
    out_run.backward(cotangent.to(dtype))
    out_ref.backward(cotangent)
    assert_close(x_run.grad, x_ref.grad, "mla_attention", dtype, "grad", "x")
    for name in params:
        assert_close(params_run[name].grad, params_ref[name].grad, "mla_attention", dtype, "grad", name)


def test_gated_nope_mla_reference_is_the_k3_formula():
    """The reference with g_proj and cos 1 / sin 0 equals Kimi K3's gated MLA written out plainly: the shared rope
    part of the key unrotated, softmax scale (nope + rope) ** -0.5, o * sigmoid(g_proj(x)) then o_proj."""
    hidden, dims, T = 40, _dims(24, False), 17
    H, N, R, V, L = (dims[k] for k in ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                        "kv_lora_rank"))
    w = {n: t.double() for n, t in _random_params(dims, hidden, seed=4).items()}
    w["g_proj"] = _init((H * V, hidden)).double()
    x = torch.randn(1, T, hidden, dtype=torch.float64)

    def norm(t, weight):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + LATENT_EPS) * weight

    q = (norm(x @ w["q_a_proj"].T, w["q_a_layernorm"]) @ w["q_b_proj"].T).view(1, T, H, N + R)
    latent, k_shared = (x @ w["kv_a_proj_with_mqa"].T).split([L, R], dim=-1)
    k_nope, v = (norm(latent, w["kv_a_layernorm"]) @ w["kv_b_proj"].T).view(1, T, H, N + V).split([N, V], dim=-1)
    k = torch.cat([k_nope, k_shared[:, :, None].expand(1, T, H, R)], dim=-1)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True, scale=(N + R) ** -0.5)
    expected = (o.transpose(1, 2).reshape(1, T, H * V) * torch.sigmoid(x @ w["g_proj"].T)) @ w["o_proj"].T
    cos, sin = _nope_tables(1, T, R)
    ours = ref.mla_attention(x, w, cos_BTR=cos, sin_BTR=sin, scale=(N + R) ** -0.5, eps=LATENT_EPS, **dims)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
