"""Tier 0's own checks: the tie-aware selection metric accepts correct top-k and rejects wrong ones,
and a broken op fails tier 0."""
from __future__ import annotations

import torch

from onboard.align.tiers import tier0_ops
from onboard.align.tiers.cases import build_case
from runtime.ops.dsa.torch_form import indexer_topk
from runtime.spec import DSAIndexer, MLAAttention, NormSpec

# the indexer's case reads only the indexer; the MLA widths around it are the tiny example's
INDEXER_LAYER = MLAAttention(num_heads=2, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                             v_head_dim=16, rope=None, indexer=DSAIndexer(num_heads=2, head_dim=16, topk=8))


def test_selection_metric_accepts_the_torch_form_and_rejects_the_worst_keys():
    case = build_case("dsa_indexer", INDEXER_LAYER, 64, 33, 0, torch.float32)
    assert tier0_ops.selection_check(indexer_topk, case.kwargs, "cpu") == 1.0

    def worst(q_BTHK, k_BTK, weights_BTH, scale, topk):
        return indexer_topk(q_BTHK, k_BTK, -weights_BTH, scale, topk)

    assert tier0_ops.selection_check(worst, case.kwargs, "cpu") < 0.9


def test_a_wrong_op_fails_tier0(monkeypatch):
    """A runtime rms_norm that forgets the (1 + w) offset is caught, forward and backward."""
    from runtime.ops.norm import torch_form as norms

    real = norms.rms_norm
    monkeypatch.setattr(norms, "rms_norm", lambda x, weight, eps, offset=0.0: real(x, weight, eps, 0.0))
    checks = tier0_ops.check_op("rms_norm", NormSpec(kind="rms_1p", eps=1e-6), 64, 17, "torch_form")
    assert any(c.verdict == "fail" and c.name.endswith("/out0") for c in checks)
    assert any(c.verdict == "fail" and "/grad:" in c.name for c in checks)


def test_stored_ops_pass_tier0_and_a_dropped_scale_fails_it(monkeypatch):
    """Tier 0 runs the stored-format ops (torch form and kernel) on codes and scales encoded in the release's format
    against the twin that decodes the same bytes; a torch form that ignores the FP8 block scales fails."""
    from runtime.formats.scheme import MXFP4, FP8Block
    from runtime.ops.stored_matmul import torch_form as stored
    from runtime.registry import StoredWeights
    from runtime.spec import MoEFFN, RouterSpec

    ffn = MoEFFN(num_experts=4, top_k=2, expert_intermediate_size=32, expert_bias=True, swiglu_limit=7.0,
                 swiglu_alpha=1.702, interleaved_gate_up=True, router=RouterSpec(scoring="softmax", norm_topk_prob=True))
    experts = StoredWeights(format=MXFP4(layout="blocks"), ffn=ffn)
    linear = StoredWeights(format=FP8Block(block=(32, 32)))
    for op, part in (("moe_experts_stored", experts), ("stored_linear", linear)):
        checks = tier0_ops.check_op(op, part, 64, 9, "torch_form") + tier0_ops.check_op(op, part, 64, 9, "kernel")
        assert {c.verdict for c in checks} <= {"pass", "skip"} and any(c.verdict == "pass" for c in checks), op
    real = stored.decode
    monkeypatch.setattr(stored, "decode", lambda codes, scale, kind, block, dtype: real(
        codes, torch.ones_like(scale), kind, block, dtype))
    checks = tier0_ops.check_op("stored_linear", linear, 64, 9, "torch_form")
    assert any(c.verdict == "fail" and c.name.endswith("/out0") for c in checks)


def test_situ_ffn_ops_pass_tier0_and_plain_silu_fails_it(monkeypatch):
    """Kimi K3's SiTU-GLU through tier 0: the experts (torch form and kernel epilogue) and the dense MLP / shared
    experts pass against the twin at the spec's betas; a torch form that runs SwiGLU instead is caught. Betas small
    enough that the tanh caps bite at these widths (K3's own, 4 and 25, barely would)."""
    from runtime.ops.mlp import torch_form as mlp
    from runtime.spec import DenseFFN, MoEFFN, RouterSpec

    situ = dict(activation="situ", situ_beta=1.0, situ_linear_beta=0.5)
    ffn = MoEFFN(num_experts=5, top_k=2, expert_intermediate_size=24, num_shared_experts=1,
                 shared_intermediate_size=48, router=RouterSpec(scoring="sigmoid", norm_topk_prob=True), **situ)
    for op, part in (("moe_experts", ffn), ("swiglu_mlp", DenseFFN(intermediate_size=40, **situ))):
        checks = tier0_ops.check_op(op, part, 64, 9, "torch_form") + tier0_ops.check_op(op, part, 64, 9, "kernel")
        assert {c.verdict for c in checks} <= {"pass", "skip"} and any(c.verdict == "pass" for c in checks), op
    monkeypatch.setattr(mlp, "situ_glu", lambda gate, up, beta, linear_beta: torch.nn.functional.silu(gate) * up)
    checks = tier0_ops.check_op("swiglu_mlp", DenseFFN(intermediate_size=40, **situ), 64, 9, "torch_form")
    assert any(c.verdict == "fail" and c.name.endswith("/out0") for c in checks)


def test_gated_nope_mla_passes_tier0_and_a_dropped_gate_fails_it(monkeypatch):
    """Kimi K3's MLA (no positions, sigmoid output gate) is an exact registry op: tier 0 passes it at its widths and
    catches a torch form that leaves the gate out."""
    from runtime.ops.mla import torch_form as mla
    from runtime.registry import OPS, ops_for_layer
    from runtime.spec import DenseFFN

    gated = MLAAttention(num_heads=3, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6,
                         v_head_dim=12, rope=None, output_gate=True)
    assert OPS["mla_attention"].supports(gated) == "exact"
    assert [name for name, _ in ops_for_layer(gated, DenseFFN(intermediate_size=8))][0] == "mla_attention"
    checks = tier0_ops.check_op("mla_attention", gated, 40, 9, "torch_form")
    assert any(c.name.endswith("grad:params.g_proj") and c.verdict == "pass" for c in checks)
    assert {c.verdict for c in checks} <= {"pass", "skip"}
    monkeypatch.setattr(mla, "output_gated", lambda o_BTX, x_BTD, params: o_BTX)
    checks = tier0_ops.check_op("mla_attention", gated, 40, 9, "torch_form")
    assert any(c.verdict == "fail" and c.name.endswith("/out0") for c in checks)


def test_attn_res_mix_passes_tier0_and_mixing_normed_sources_fails_it(monkeypatch):
    """Block attention residuals' mix (Kimi K3) through tier 0; a torch form that sums the normed sources instead of
    the raw ones (the keys for the values) is caught."""
    from runtime.ops.attn_res import torch_form as attn_res
    from runtime.registry import OPS, ops_for_layer
    from runtime.spec import AttnResSpec, DenseFFN

    part = AttnResSpec(block_size=12)
    assert OPS["attn_res_mix"].supports(part) == "exact"
    assert ("attn_res_mix", part) in ops_for_layer(INDEXER_LAYER, DenseFFN(intermediate_size=8), attn_res=part)
    checks = tier0_ops.check_op("attn_res_mix", part, 48, 9, "torch_form")
    assert {c.verdict for c in checks} <= {"pass", "skip"} and any(c.name.endswith("grad:query_D") for c in checks)
    real = attn_res.attn_res_mix
    monkeypatch.setattr(attn_res, "attn_res_mix", lambda sources, query_D, norm_weight_D, eps, offset=0.0: real(
        tuple(s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) for s in sources), query_D, norm_weight_D, eps))
    checks = tier0_ops.check_op("attn_res_mix", part, 48, 9, "torch_form")
    assert any(c.verdict == "fail" and c.name.endswith("/out0") for c in checks)


def test_latent_moe_experts_run_tier0_at_the_latent_width():
    """Kimi K3's latent MoE: tier 0 runs the routed experts at routed_expert_hidden_size, as the layer does."""
    from runtime.spec import MoEFFN, RouterSpec

    ffn = MoEFFN(num_experts=5, top_k=2, expert_intermediate_size=24, latent_size=32, latent_norm=True,
                 router=RouterSpec(scoring="sigmoid", norm_topk_prob=True), activation="situ", situ_beta=4.0,
                 situ_linear_beta=25.0)
    case = build_case("moe_experts", ffn, 64, 9, 0, torch.float32)
    assert case.kwargs["x_TD"].shape[-1] == 32 and case.kwargs["w_gate_up_E2FD"].shape[-1] == 32
    checks = tier0_ops.check_op("moe_experts", ffn, 64, 9, "torch_form")
    assert {c.verdict for c in checks} <= {"pass", "skip"} and any(c.verdict == "pass" for c in checks)
