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
        checks = tier0_ops.check_op(op, part, 64, 9, "fallback") + tier0_ops.check_op(op, part, 64, 9, "kernel")
        assert {c.verdict for c in checks} <= {"pass", "skip"} and any(c.verdict == "pass" for c in checks), op
    real = stored.decode
    monkeypatch.setattr(stored, "decode", lambda codes, scale, kind, block, dtype: real(
        codes, torch.ones_like(scale), kind, block, dtype))
    checks = tier0_ops.check_op("stored_linear", linear, 64, 9, "fallback")
    assert any(c.verdict == "fail" and c.name.endswith("/out0") for c in checks)
