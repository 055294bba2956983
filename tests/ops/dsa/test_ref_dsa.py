"""DSA fp64 reference vs transformers' DeepseekV32 (indexer and whole attention layer), and the
torch form in runtime/ops/dsa/torch_form.py vs the reference (forward and gradients).

Shape legend: B batch, T tokens, H heads, K key width, V value width, S selected keys, D width.
"""
import pytest
import torch
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

from reference_ops import dsa as ref
from runtime.ops.dsa import torch_form as ops
from runtime.tolerances import assert_close
from tests.ops.dsa.dsa_problems import assert_same_selection, random_sparse_problem


def tiny_config(index_topk):
    config = hf.DeepseekV32Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        index_n_heads=3, index_head_dim=16, index_topk=index_topk, num_hidden_layers=1,
        vocab_size=32, intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4,
        n_group=1, topk_group=1, num_experts_per_tok=2,
    )
    config._attn_implementation = "sdpa"
    return config


def make_layer(index_topk, seed=0):
    """A DeepseekV32Attention in fp64 with random weights (LayerNorm affine made non-trivial)."""
    torch.manual_seed(seed)
    config = tiny_config(index_topk)
    layer = hf.DeepseekV32Attention(config, layer_idx=0).double()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.3)
    return config, layer


def layer_inputs(config, T, B=2, seed=1):
    torch.manual_seed(seed)
    x_BTD = torch.randn(B, T, config.hidden_size, dtype=torch.float64)
    positions_BT = torch.arange(T).expand(B, T)
    cos_BTR, sin_BTR = hf.DeepseekV32RotaryEmbedding(config)(x_BTD, positions_BT)
    causal_11TT = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)
    return x_BTD, cos_BTR, sin_BTR, causal_11TT


def reference_kwargs(config, layer, cos_BTR, sin_BTR):
    return dict(
        num_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
        cos_BTR=cos_BTR, sin_BTR=sin_BTR, scale=layer.scaling, eps=1e-6,
        index_num_heads=config.index_n_heads, index_head_dim=config.index_head_dim,
        index_topk=config.index_topk,
    )


def params_of(layer):
    """Release names: module names, except the indexer LayerNorm's weight and bias."""
    params = {}
    for name, w in layer.state_dict().items():
        params[name if "k_norm" in name else name.removesuffix(".weight")] = w.detach()
    return params


@pytest.mark.parametrize("T,topk", [(9, 16), (37, 8), (63, 20)], ids=["T9-all-keys", "T37-top8", "T63-top20"])
def test_indexer_selects_what_transformers_selects(T, topk):
    config, layer = make_layer(topk)
    x_BTD, cos_BTR, sin_BTR, causal_11TT = layer_inputs(config, T)
    with torch.no_grad():
        q_resid_BTQ = layer.q_a_layernorm(layer.q_a_proj(x_BTD))
        hf_idx_BTS = layer.indexer(x_BTD, q_resid_BTQ, (cos_BTR, sin_BTR), causal_11TT[:, 0], None)
        q_BTIJ, k_BTJ, w_BTI = ref.indexer_inputs(
            x_BTD, q_resid_BTQ, params_of(layer), num_heads=config.index_n_heads,
            head_dim=config.index_head_dim, rope_dim=config.qk_rope_head_dim,
            cos_BTR=cos_BTR, sin_BTR=sin_BTR)
        idx_BTS = ref.topk_indices(ref.indexer_scores(q_BTIJ, k_BTJ, w_BTI, config.index_head_dim**-0.5), topk)
    assert idx_BTS.shape == hf_idx_BTS.shape
    t_BT1 = torch.arange(T).view(1, T, 1)
    # transformers pads early rows with masked (future) keys; we pad with -1
    hf_valid = torch.where(hf_idx_BTS <= t_BT1, hf_idx_BTS.long(), -1)
    assert torch.equal(hf_valid.sort(-1).values, idx_BTS.sort(-1).values)


@pytest.mark.parametrize("T,topk", [(9, 16), (37, 8), (63, 20)], ids=["T9-all-keys", "T37-top8", "T63-top20"])
def test_whole_layer_matches_transformers(T, topk):
    config, layer = make_layer(topk)
    x_BTD, cos_BTR, sin_BTR, causal_11TT = layer_inputs(config, T)
    with torch.no_grad():
        expected_BTD, _ = layer(x_BTD, (cos_BTR, sin_BTR), causal_11TT)
    actual_BTD = ref.dsa_mla_attention(x_BTD, params_of(layer), **reference_kwargs(config, layer, cos_BTR, sin_BTR))
    # transformers computes its RMSNorms in fp32 even for fp64 inputs (observed ~1e-7 rel rms),
    # so this comparison is held to the fp32 entry, not the fp64 one
    assert_close(actual_BTD, expected_BTD, "dsa_mla_attention", dtype=torch.float32)


def test_layer_is_sparse_when_topk_is_below_T():
    """Guards the layer test: with top-8 of 37 keys the result must differ from dense MLA."""
    config, layer = make_layer(8)
    x_BTD, cos_BTR, sin_BTR, causal_11TT = layer_inputs(config, 37)
    kwargs = reference_kwargs(config, layer, cos_BTR, sin_BTR)
    sparse_BTD = ref.dsa_mla_attention(x_BTD, params_of(layer), **kwargs)
    dense_BTD = ref.dsa_mla_attention(x_BTD, params_of(layer), **{**kwargs, "index_topk": 37})
    assert (sparse_BTD - dense_BTD).norm() > 1e-2 * dense_BTD.norm()


def test_topk_indices_pads_early_queries_with_minus_one():
    torch.manual_seed(0)
    scores_BTT = ref.indexer_scores(torch.randn(1, 7, 2, 4), torch.randn(1, 7, 4), torch.rand(1, 7, 2), 0.5)
    idx_BTS = ref.topk_indices(scores_BTT, 4)
    assert idx_BTS.shape == (1, 7, 4)
    for t in range(7):
        valid = idx_BTS[0, t][idx_BTS[0, t] >= 0]
        assert len(valid) == min(t + 1, 4) and (valid <= t).all()
    assert ref.topk_indices(scores_BTT, 50).shape == (1, 7, 7)


def test_sparse_attention_matches_dense_masked_attention():
    B, T, H, K, V, S = 2, 21, 3, 10, 6, 5
    q_BTHK, kv_BTK, idx_BTS = random_sparse_problem(B, T, H, K, S, torch.float64)
    allowed_BTT = torch.zeros(B, T, T + 1, dtype=torch.bool).scatter(-1, idx_BTS % (T + 1), True)[..., :T]
    logits_BHTT = torch.einsum("bthk,bsk->bhts", q_BTHK, kv_BTK) * 0.3
    probs_BHTT = logits_BHTT.masked_fill(~allowed_BTT[:, None], float("-inf")).softmax(-1)
    expected_BTHV = torch.einsum("bhts,bsv->bthv", probs_BHTT, kv_BTK[..., :V])
    actual_BTHV = ref.sparse_attention(q_BTHK, kv_BTK, idx_BTS, 0.3, V)
    assert_close(actual_BTHV, expected_BTHV, "dsa_attention")


def test_sparse_attention_reference_gradients_pass_gradcheck():
    q_BTHK, kv_BTK, idx_BTS = random_sparse_problem(1, 6, 2, 5, 3, torch.float64)
    inputs = (q_BTHK.requires_grad_(), kv_BTK.requires_grad_())
    assert torch.autograd.gradcheck(lambda q, kv: ref.sparse_attention(q, kv, idx_BTS, 0.4, 3), inputs)


TORCH_FORM_CASES = [
    pytest.param(1, 63, 4, 48, 32, 8, torch.float32, id="T63-H4-K48-S8-fp32"),
    pytest.param(2, 37, 3, 24, 16, 40, torch.float32, id="B2-T37-S40-fp32"),
    pytest.param(1, 63, 4, 48, 32, 8, torch.bfloat16, id="T63-H4-K48-S8-bf16"),
]


@pytest.mark.parametrize("B,T,H,K,V,S,dtype", TORCH_FORM_CASES)
def test_torch_form_sparse_attention_forward_and_grads(B, T, H, K, V, S, dtype):
    q_BTHK, kv_BTK, idx_BTS = random_sparse_problem(B, T, H, K, S, dtype)
    do_BTHV = torch.randn(B, T, H, V).to(dtype)
    grads = {}
    for name, fn, cast in (("ref", ref.sparse_attention, torch.float64), ("ops", ops.sparse_attention, dtype)):
        q, kv = q_BTHK.to(cast).requires_grad_(), kv_BTK.to(cast).requires_grad_()
        # a small query block makes the torch form's blocking visible at this T
        extra = {"block_size": 16} if name == "ops" else {}
        o_BTHV = fn(q, kv, idx_BTS, K**-0.5, V, **extra)
        o_BTHV.backward(do_BTHV.to(cast))
        grads[name] = (o_BTHV, q.grad, kv.grad)
    for label, actual, expected in zip(("o", "dq", "dkv"), grads["ops"], grads["ref"]):
        assert_close(actual, expected, "dsa_attention", dtype, "out" if label == "o" else "grad", label)


@pytest.mark.parametrize("T,topk,block_size", [(63, 8, 16), (37, 50, 8)], ids=["T63-top8-blk16", "T37-top50-blk8"])
def test_torch_form_indexer_topk_selects_the_reference_set(T, topk, block_size):
    g = torch.Generator().manual_seed(3)
    q_BTHK, k_BTK, w_BTH = torch.randn(2, T, 3, 16, generator=g), torch.randn(2, T, 16, generator=g), torch.randn(2, T, 3, generator=g)
    scores_BTT = ref.indexer_scores(q_BTHK, k_BTK, w_BTH, 0.25)
    actual_BTS = ops.indexer_topk(q_BTHK, k_BTK, w_BTH, 0.25, topk, block_size=block_size)
    assert_same_selection(actual_BTS, ref.topk_indices(scores_BTT, topk), scores_BTT)
