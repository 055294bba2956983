"""MoE: the fp64 reference vs transformers' own MoE blocks of ten families (same weights, forward and
every gradient), and the torch form vs the reference (routing rules, expert variants, LoRA)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeSparseMoeBlock
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE
from transformers.models.minimax.modeling_minimax import MiniMaxSparseMoeBlock
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from tests.opcheck import check_route
from reference_ops import mlp as ref_mlp
from reference_ops import moe as ref
from runtime.ops.moe import torch_form as run
from runtime.tolerances import assert_close

D, F_EXPERT = 32, 16


def _mlp(x, mlp):
    return ref_mlp.swiglu_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


def _experts(x, block, weights, idx):
    return ref.swiglu_experts(x, weights, idx, block.experts.gate_up_proj, block.experts.down_proj)


def ours_softmax_topk(block, x):
    """Qwen3-MoE, OLMoE, Mixtral, MiniMax: softmax, top-k, optional renormalization."""
    norm = getattr(block.gate, "norm_topk_prob", True)
    weights, idx = ref.route(x @ block.gate.weight.T, block.gate.top_k, norm_topk_prob=norm)
    return _experts(x, block, weights, idx)


def ours_qwen3_next(block, x):
    shared = torch.sigmoid(x @ block.shared_expert_gate.weight.T) * _mlp(x, block.shared_expert)
    return ours_softmax_topk(block, x) + shared


def ours_sigmoid_grouped(block, x):
    """DeepSeek-V3, GLM-4-MoE, Kimi-Linear: sigmoid, correction bias, group-limited, routed scaling."""
    g = block.gate
    weights, idx = ref.route(
        x @ g.weight.T, g.top_k, scoring="sigmoid", norm_topk_prob=g.norm_topk_prob,
        routed_scaling_factor=g.routed_scaling_factor, correction_bias_E=g.e_score_correction_bias,
        num_groups=g.num_group, topk_groups=g.topk_group,
    )
    return _experts(x, block, weights, idx) + _mlp(x, block.shared_experts)


def ours_ernie(block, x):
    # Ernie divides by max(sum, moe_norm_min=1e-12): the same as norm_topk_prob for any real sum.
    g = block.gate
    weights, idx = ref.route(
        x @ g.weight.T, g.top_k, norm_topk_prob=True, correction_bias_E=g.moe_statics.e_score_correction_bias[0]
    )
    return _experts(x, block, weights, idx) + _mlp(x, block.shared_experts)


def ours_gpt_oss(block, x):
    # gpt-oss stores experts transposed ([E, D, 2F], [E, F, D]) with gate/up columns interleaved.
    ex = block.experts
    weights, idx = ref.route(x @ block.router.weight.T + block.router.bias, block.router.top_k,
                             norm_topk_prob=False, topk_before_softmax=True)
    return ref.swiglu_experts(
        x, weights, idx, ex.gate_up_proj.transpose(1, 2), ex.down_proj.transpose(1, 2),
        b_gate_up_E2F=ex.gate_up_proj_bias, b_down_ED=ex.down_proj_bias,
        clamp=ex.limit, glu_alpha=ex.alpha, interleaved_gate_up=True,
    )


@dataclass
class Family:
    block: Callable[[], torch.nn.Module]
    ours: Callable
    # Every router but gpt-oss computes its softmax/sigmoid in fp32 inside transformers, which caps
    # the whole block's agreement at fp32 level; the experts alone are checked at fp64 below.
    compare_dtype: torch.dtype = torch.float32
    expert_std: float = 0.3


def _cfg(name, **kw):
    return getattr(transformers, name)(hidden_size=D, experts_implementation="eager", **kw)


FAMILIES = {
    "qwen3_moe": Family(lambda: Qwen3MoeSparseMoeBlock(_cfg("Qwen3MoeConfig", moe_intermediate_size=F_EXPERT, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False)), ours_softmax_topk),
    "qwen3_next": Family(lambda: Qwen3NextSparseMoeBlock(_cfg("Qwen3NextConfig", moe_intermediate_size=F_EXPERT, shared_expert_intermediate_size=24, num_experts=7, num_experts_per_tok=3, norm_topk_prob=True)), ours_qwen3_next),
    "mixtral": Family(lambda: MixtralSparseMoeBlock(_cfg("MixtralConfig", intermediate_size=F_EXPERT, num_local_experts=6, num_experts_per_tok=2)), ours_softmax_topk),
    "olmoe": Family(lambda: OlmoeSparseMoeBlock(_cfg("OlmoeConfig", intermediate_size=F_EXPERT, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True)), ours_softmax_topk),
    "minimax": Family(lambda: MiniMaxSparseMoeBlock(_cfg("MiniMaxConfig", intermediate_size=F_EXPERT, num_local_experts=5, num_experts_per_tok=2)), ours_softmax_topk),
    "deepseek_v3": Family(lambda: DeepseekV3MoE(_cfg("DeepseekV3Config", moe_intermediate_size=F_EXPERT, n_routed_experts=12, num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1)), ours_sigmoid_grouped),
    "glm4_moe": Family(lambda: Glm4MoeMoE(_cfg("Glm4MoeConfig", moe_intermediate_size=F_EXPERT, n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5, n_shared_experts=1)), ours_sigmoid_grouped),
    "kimi_linear": Family(lambda: KimiLinearMoE(_cfg("KimiLinearConfig", moe_intermediate_size=F_EXPERT, num_experts=8, num_experts_per_token=2, num_expert_group=2, topk_group=1, routed_scaling_factor=2.446, num_shared_experts=1)), ours_sigmoid_grouped),
    "ernie4_5_moe": Family(lambda: Ernie4_5_MoeSparseMoeBlock(_cfg("Ernie4_5_MoeConfig", moe_intermediate_size=F_EXPERT, moe_num_experts=6, moe_k=2, moe_num_shared_experts=1)), ours_ernie),
    # Large expert weights push gate/up past the 7.0 clamp so both sides of it are exercised.
    "gpt_oss": Family(lambda: GptOssMLP(_cfg("GptOssConfig", intermediate_size=F_EXPERT, num_local_experts=6, num_experts_per_tok=2)), ours_gpt_oss, torch.float64, expert_std=1.5),
}


def _randomized(family: Family) -> torch.nn.Module:
    torch.manual_seed(0)
    block = family.block().double()
    for name, tensor in [*block.named_parameters(), *block.named_buffers()]:
        std = family.expert_std if "experts.gate_up_proj" in name and "bias" not in name else 0.3
        tensor.data.normal_(0.0, std)
    return block


@pytest.mark.parametrize("name", list(FAMILIES))
def test_reference_matches_transformers_block(name):
    family = FAMILIES[name]
    block = _randomized(family)
    x_BTD = torch.randn(2, 7, D, dtype=torch.float64, requires_grad=True)
    theirs = block(x_BTD)
    theirs = (theirs[0] if isinstance(theirs, tuple) else theirs).reshape(14, D)
    ours = family.ours(block, x_BTD.reshape(14, D))
    assert_close(ours, theirs, "moe_block", family.compare_dtype, "out", name)
    trainable = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
    leaves = [x_BTD, *(p for _, p in trainable)]
    cotangent = torch.randn_like(theirs)
    grads_theirs = torch.autograd.grad(theirs, leaves, cotangent, allow_unused=True)
    grads_ours = torch.autograd.grad(ours, leaves, cotangent, allow_unused=True)
    names = ["x", *(n for n, _ in trainable)]
    for leaf_name, a, e in zip(names, grads_ours, grads_theirs):
        assert (a is None) == (e is None), f"{name}: gradient presence differs for {leaf_name}"
        if e is not None:
            assert_close(a, e, "moe_block", family.compare_dtype, "grad", f"{name} {leaf_name}")


def _expert_call_ours(name, block, x, weights, idx):
    if name != "gpt_oss":
        return _experts(x, block, weights, idx)
    ex = block.experts
    return ref.swiglu_experts(
        x, weights, idx, ex.gate_up_proj.transpose(1, 2), ex.down_proj.transpose(1, 2),
        b_gate_up_E2F=ex.gate_up_proj_bias, b_down_ED=ex.down_proj_bias,
        clamp=ex.limit, glu_alpha=ex.alpha, interleaved_gate_up=True,
    )


@pytest.mark.parametrize("name", list(FAMILIES))
def test_reference_experts_match_transformers_experts_in_fp64(name):
    """Same routing fed to both: the expert math agrees to fp64 precision in every family."""
    block = _randomized(FAMILIES[name])
    E, k = block.experts.num_experts, 2
    x = torch.randn(14, D, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(14)])
    weights = torch.rand(14, k, dtype=torch.float64, requires_grad=True)
    theirs = block.experts(x, idx, weights)
    ours = _expert_call_ours(name, block, x, weights, idx)
    assert_close(ours, theirs, "swiglu_experts", torch.float64, "out", name)
    leaves = [x, weights, *block.experts.parameters()]
    cot = torch.randn_like(theirs)
    for a, e in zip(torch.autograd.grad(ours, leaves, cot), torch.autograd.grad(theirs, leaves, cot)):
        assert_close(a, e, "swiglu_experts", torch.float64, "grad", name)


def test_gpt_oss_case_exercises_the_clamp():
    block = _randomized(FAMILIES["gpt_oss"])
    gate_up = torch.randn(14, D, dtype=torch.float64) @ block.experts.gate_up_proj[0]
    assert (gate_up > 7.0).any() and (gate_up < -7.0).any()


ROUTE_CASES = {
    "softmax-k3": dict(top_k=3, norm_topk_prob=False),
    "softmax-norm": dict(top_k=3, norm_topk_prob=True),
    "softmax-groups-max": dict(top_k=2, norm_topk_prob=True, num_groups=4, topk_groups=2),
    "softmax-bias": dict(top_k=4, norm_topk_prob=True, correction_bias=True),
    "sigmoid-groups-bias-scaled": dict(top_k=3, scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, correction_bias=True, num_groups=4, topk_groups=2),
    "sigmoid-nonorm": dict(top_k=2, scoring="sigmoid", norm_topk_prob=False),
    "topk-before-softmax": dict(top_k=2, norm_topk_prob=False, topk_before_softmax=True),
}


@pytest.mark.parametrize("case", list(ROUTE_CASES))
def test_torch_form_route_matches_reference(case):
    torch.manual_seed(3)
    kwargs = dict(ROUTE_CASES[case])
    top_k = kwargs.pop("top_k")
    if kwargs.pop("correction_bias", False):
        kwargs["correction_bias_E"] = torch.randn(12) * 0.1
    check_route(run.route, ref.route, torch.randn(63, 12), top_k, case, **kwargs)


def test_group_limited_routing_only_picks_from_kept_groups():
    torch.manual_seed(4)
    logits = torch.randn(63, 12, dtype=torch.float64)
    _, idx = ref.route(logits, 3, scoring="sigmoid", norm_topk_prob=True, num_groups=4, topk_groups=1)
    assert (idx // 3 == idx[:, :1] // 3).all()


def _expert_inputs(E, k, T=37, with_bias=False, lora_rank=0, empty_expert=None, seed=0):
    torch.manual_seed(seed)
    choices = [e for e in range(E) if e != empty_expert]
    idx = torch.stack([torch.tensor(choices)[torch.randperm(len(choices))[:k]] for _ in range(T)])
    inputs = {
        "x_TD": torch.randn(T, D),
        "weights_Tk": torch.rand(T, k) + 0.1,
        "w_gate_up_E2FD": torch.randn(E, 2 * F_EXPERT, D) * 0.3,
        "w_down_EDF": torch.randn(E, D, F_EXPERT) * 0.3,
    }
    if with_bias:
        inputs |= {"b_gate_up_E2F": torch.randn(E, 2 * F_EXPERT), "b_down_ED": torch.randn(E, D)}
    if lora_rank:
        inputs |= {
            "lora_gate_up": (torch.randn(E, lora_rank, D) * 0.3, torch.randn(E, 2 * F_EXPERT, lora_rank) * 0.3),
            "lora_down": (torch.randn(E, lora_rank, F_EXPERT) * 0.3, torch.randn(E, D, lora_rank) * 0.3),
        }
    return inputs, idx


EXPERT_CASES = {
    "silu-E6-k2": dict(E=6, k=2),
    "silu-E7-k3-empty-expert": dict(E=7, k=3, empty_expert=4),
    "gptoss-clamp-interleaved-bias": dict(E=5, k=2, with_bias=True, static=dict(clamp=1.5, glu_alpha=1.702, interleaved_gate_up=True)),
    "silu-clamp-only": dict(E=6, k=2, static=dict(clamp=1.0)),
    "gelu-tanh": dict(E=6, k=2, static=dict(activation="gelu_pytorch_tanh")),
    "lora-r4": dict(E=6, k=2, lora_rank=4, static=dict(lora_scale=0.5)),
    # Kimi K3's SiTU-GLU at its released betas, and at caps the pre-activations here (std ~1.7) saturate
    "situ-k3-betas": dict(E=6, k=2, static=dict(activation="situ", situ_betas=(4.0, 25.0))),
    "situ-saturating-lora": dict(E=7, k=3, empty_expert=4, lora_rank=3,
                                 static=dict(activation="situ", situ_betas=(1.0, 0.5), lora_scale=0.5)),
    "situ-up-uncapped": dict(E=6, k=2, static=dict(activation="situ", situ_betas=(0.7, None))),
}


def _leaves(inputs: dict) -> dict:
    """Flatten LoRA pairs into named leaves for gradient checks."""
    flat = {}
    for name, value in inputs.items():
        if isinstance(value, tuple):
            flat |= {f"{name}.A": value[0], f"{name}.B": value[1]}
        else:
            flat[name] = value
    return flat


def _unflatten(leaves: dict) -> dict:
    out = {}
    for name, value in leaves.items():
        if name.endswith(".A"):
            out[name[:-2]] = (value, leaves[name[:-2] + ".B"])
        elif not name.endswith(".B"):
            out[name] = value
    return out


@pytest.mark.parametrize("dtype", [pytest.param(torch.float64, id="fp64-loop"), pytest.param(torch.float32, id="fp32-grouped_mm")])
@pytest.mark.parametrize("case", list(EXPERT_CASES))
def test_torch_form_experts_match_reference(case, dtype):
    spec = dict(EXPERT_CASES[case])
    static = spec.pop("static", {})
    inputs, idx = _expert_inputs(**spec)
    run_leaves = {n: t.to(dtype).requires_grad_() for n, t in _leaves(inputs).items()}
    ref_leaves = {n: t.detach().double().requires_grad_() for n, t in run_leaves.items()}
    out_run = run.swiglu_experts(idx_Tk=idx, **_unflatten(run_leaves), **static)
    out_ref = ref.swiglu_experts(idx_Tk=idx, **_unflatten(ref_leaves), **static)
    assert out_run.dtype == dtype
    assert_close(out_run, out_ref, "swiglu_experts", dtype, "out", case)
    cot = torch.randn_like(out_ref)
    out_run.backward(cot.to(dtype))
    out_ref.backward(cot)
    for name in run_leaves:
        assert_close(run_leaves[name].grad, ref_leaves[name].grad, "swiglu_experts", dtype, "grad", f"{case} {name}")


def test_empty_expert_gets_zero_weight_grad():
    inputs, idx = _expert_inputs(E=7, k=3, empty_expert=4)
    w = inputs["w_gate_up_E2FD"].requires_grad_()
    run.swiglu_experts(idx_Tk=idx, **inputs).sum().backward()
    assert torch.equal(w.grad[4], torch.zeros_like(w.grad[4])) and w.grad.abs().sum() > 0
