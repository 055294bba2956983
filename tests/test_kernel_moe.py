"""MoE Triton kernels under TRITON_INTERPRET=1 vs the fp64 reference: routed SwiGLU experts forward
and every gradient (x, routing weights, expert weights, biases, LoRA A/B), with NaN-prefilled
buffers, x read from a copy in expert order and gathered by token, an expert that receives no tokens, an expert count divisible by nothing convenient,
the gpt-oss GLU (clamp, alpha, interleaved gate/up, transposed weight views) and frozen experts;
then each `Tuning` variant (h stored scaled, x copied inside the gate/up GEMM, the GLU backward on
its own row tile, split-K weight gradients, all together) over the same kinds of problem.

Shape legend: T tokens, D model width, E experts, F expert width, k top-k, r LoRA rank.
fp32 inputs: under the interpreter a tl.dot on bf16 operands is wrong in triton 3.9.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from reference_ops import moe as ref  # noqa: E402
from runtime.kernels import moe as kernels  # noqa: E402
from runtime.kernels.moe import buffers, combine, experts, grouped_wgrad, schedule  # noqa: E402
from runtime.tolerances import assert_close  # noqa: E402

pytestmark = pytest.mark.interpreter

T, D, F_EXPERT = 37, 32, 16


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """Every buffer a kernel writes starts as NaN, so an unwritten element fails the comparison."""
    monkeypatch.setattr(buffers, "empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


def _routing(E, k, empty_expert, seed):
    g = torch.Generator().manual_seed(seed)
    choices = torch.tensor([e for e in range(E) if e != empty_expert])
    idx = torch.stack([choices[torch.randperm(len(choices), generator=g)[:k]] for _ in range(T)])
    return idx, torch.rand(T, k, generator=g) + 0.1


def _problem(E=6, k=2, empty_expert=None, bias=False, lora_rank=0, transposed=False, seed=0):
    """Leaves (name -> fp32 tensor) and the index; gpt-oss stores its experts transposed."""
    torch.manual_seed(seed)
    idx, weights = _routing(E, k, empty_expert, seed)
    leaves = {"x_TD": torch.randn(T, D), "weights_Tk": weights,
              "w_gate_up_E2FD": torch.randn(E, 2 * F_EXPERT, D) * 0.3, "w_down_EDF": torch.randn(E, D, F_EXPERT) * 0.3}
    if transposed:
        leaves["w_gate_up_E2FD"] = leaves["w_gate_up_E2FD"].transpose(1, 2).contiguous().transpose(1, 2)
        leaves["w_down_EDF"] = leaves["w_down_EDF"].transpose(1, 2).contiguous().transpose(1, 2)
    if bias:
        leaves |= {"b_gate_up_E2F": torch.randn(E, 2 * F_EXPERT), "b_down_ED": torch.randn(E, D)}
    if lora_rank:
        leaves |= {"lora_gate_up.A": torch.randn(E, lora_rank, D) * 0.3, "lora_gate_up.B": torch.randn(E, 2 * F_EXPERT, lora_rank) * 0.3,
                   "lora_down.A": torch.randn(E, lora_rank, F_EXPERT) * 0.3, "lora_down.B": torch.randn(E, D, lora_rank) * 0.3}
    return leaves, idx


def _call(fn, leaves, idx, **static):
    args = {n: v for n, v in leaves.items() if "." not in n}
    for pair in ("lora_gate_up", "lora_down"):
        if f"{pair}.A" in leaves:
            args[pair] = (leaves[f"{pair}.A"], leaves[f"{pair}.B"])
    return fn(idx_Tk=idx, **args, **static)


def check_experts(leaves, idx, frozen=(), tuning=experts.Tuning(), **static):
    """Kernel (fp32, variants `tuning`) vs reference (fp64): output and the gradient of every leaf
    not in `frozen`."""
    run_in = {n: t.detach().requires_grad_(n not in frozen) for n, t in leaves.items()}
    ref_in = {n: t.detach().double().requires_grad_(n not in frozen) for n, t in leaves.items()}
    out = _call(kernels.swiglu_experts, run_in, idx, tuning=tuning, **static)
    expected = _call(ref.swiglu_experts, ref_in, idx, **static)
    assert_close(out, expected, "swiglu_experts", torch.float32, "out")
    cot = torch.randn_like(expected)
    out.backward(cot.float())
    expected.backward(cot)
    for name in leaves:
        if name in frozen:
            assert run_in[name].grad is None
            continue
        assert run_in[name].grad is not None, f"no gradient reached {name}"
        assert_close(run_in[name].grad, ref_in[name].grad, "swiglu_experts", torch.float32, "grad", name)


CASES = {
    "T37-E6-k2": dict(),
    "T37-E7-k3-empty-expert": dict(E=7, k=3, empty_expert=4),
    "T37-E11-k1": dict(E=11, k=1, seed=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_experts_match_reference(case):
    leaves, idx = _problem(**CASES[case])
    check_experts(leaves, idx)


def test_gpt_oss_glu_with_biases_and_transposed_weights():
    leaves, idx = _problem(E=5, bias=True, transposed=True, seed=3)
    # 1.5 is inside the spread of gate/up here, so both sides of the clamp are exercised
    check_experts(leaves, idx, clamp=1.5, glu_alpha=1.702, interleaved_gate_up=True)


def test_silu_with_clamp_only():
    leaves, idx = _problem(seed=4)
    check_experts(leaves, idx, clamp=1.0)


def test_frozen_experts_input_grads_only():
    # no weight gradient reads x again, so the gate/up GEMM gathers x by token instead of a copy
    leaves, idx = _problem(E=7, k=3, empty_expert=2, seed=8)
    check_experts(leaves, idx, frozen=("w_gate_up_E2FD", "w_down_EDF"))


def test_lora_on_frozen_experts_skips_base_weight_grads(monkeypatch):
    leaves, idx = _problem(E=7, k=2, empty_expert=1, lora_rank=4, seed=5)
    calls = []
    real = experts.grouped_wgrad
    monkeypatch.setattr(experts, "grouped_wgrad", lambda a, b, *args, **kw: calls.append(a.shape) or real(a, b, *args, **kw))
    check_experts(leaves, idx, frozen=("w_gate_up_E2FD", "w_down_EDF"), lora_scale=0.5)
    # four LoRA weight grads and no dense [2F, D] / [D, F] expert grads
    assert len(calls) == 4


def test_lora_with_trainable_experts_and_gpt_oss_glu():
    leaves, idx = _problem(E=6, k=2, bias=True, lora_rank=3, seed=6)
    check_experts(leaves, idx, lora_scale=2.0, clamp=1.5, glu_alpha=1.702, interleaved_gate_up=True)


def test_sum_k_over_two_column_blocks():
    # D 1100 spans two 1024-wide column blocks, the second one masked
    rows_SD = torch.randn(5 * 3, 1100)
    out = combine.sum_k(rows_SD, 3)
    assert_close(out, rows_SD.double().view(5, 3, 1100).sum(1), "swiglu_experts", torch.float32, "out")


def test_schedule_covers_every_row_once():
    idx, _ = _routing(7, 3, 4, seed=7)
    sched = schedule.build_schedule(idx, 7, block_m=16)
    covered = torch.zeros(idx.numel(), dtype=torch.int64)
    for e, start in zip(sched.tile_expert.tolist(), sched.tile_start.tolist()):
        if e < 7:
            end = min(start + 16, int(sched.ends_E[e]))
            assert (sched.expert_S[start:end] == e).all()
            covered[start:end] += 1
    assert (covered == 1).all()
    assert torch.equal(torch.sort(sched.pair_S.long()).values, torch.arange(idx.numel()))


TUNINGS = {
    "scaled-h": experts.Tuning(scaled_h=True),
    "fused-x-copy": experts.Tuning(fused_x_copy=True),
    # 16-row tiles split the larger experts here into two tiles, unlike the schedule's 64
    "glu-bwd-m16": experts.Tuning(glu_bwd_block_m=16),
    "wgrad-split3": experts.Tuning(wgrad_split_k=3),
    "all": experts.Tuning(scaled_h=True, fused_x_copy=True, glu_bwd_block_m=16, wgrad_split_k=3),
}
GPT_OSS = dict(clamp=1.5, glu_alpha=1.702, interleaved_gate_up=True)
TUNING_PROBLEMS = {
    "E7-k3-empty-expert": (dict(E=7, k=3, empty_expert=4), (), {}),
    "gpt-oss-biases-transposed": (dict(E=5, bias=True, transposed=True, seed=3), (), GPT_OSS),
    "lora-gpt-oss-biases": (dict(E=6, bias=True, lora_rank=3, seed=6), (), dict(lora_scale=2.0, **GPT_OSS)),
    "lora-frozen-base": (dict(E=7, empty_expert=1, lora_rank=4, seed=5), ("w_gate_up_E2FD", "w_down_EDF"),
                         dict(lora_scale=0.5)),
}


@pytest.mark.parametrize("problem", list(TUNING_PROBLEMS))
@pytest.mark.parametrize("tuning", list(TUNINGS))
def test_tuning_variants_match_reference(tuning, problem):
    shape, frozen, static = TUNING_PROBLEMS[problem]
    leaves, idx = _problem(**shape)
    check_experts(leaves, idx, frozen=frozen, tuning=TUNINGS[tuning], **static)


def test_fused_x_copy_writes_every_row_of_the_copy(monkeypatch):
    # the copy feeds only the gate/up weight gradient: check the buffer itself, not just that grad
    leaves, idx = _problem(E=7, k=3, empty_expert=4, seed=9)
    copies = []
    real = experts._gate_up
    monkeypatch.setattr(experts, "_gate_up", lambda *a: copies.append(a[-1]) or real(*a))
    x_TD = leaves["x_TD"].requires_grad_()
    w_gu = leaves["w_gate_up_E2FD"].requires_grad_()
    kernels.swiglu_experts(x_TD, leaves["weights_Tk"], idx, w_gu, leaves["w_down_EDF"],
                           tuning=experts.Tuning(fused_x_copy=True))
    order = schedule.build_schedule(idx, 7, block_m=64).token_S.long()
    assert copies[0] is not None and torch.equal(copies[0], x_TD.detach()[order])


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_wgrad_split_k_with_partial_and_empty_chunks(split_k):
    # 16-row steps over about 18 rows per expert: chunks that are full, partial and empty
    idx, _ = _routing(3, 1, 1, seed=10)
    sched = schedule.build_schedule(idx, 3, block_m=16)
    a_SM, b_SN, scale_S = torch.randn(T, 24), torch.randn(T, 40), torch.rand(T)
    config = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=16, num_warps=4)
    out = grouped_wgrad.grouped_wgrad(a_SM, b_SN, sched, row_scale_S=scale_S, alpha=0.5, split_k=split_k, config=config)
    expected = torch.zeros(3, 24, 40, dtype=torch.float64)
    rows = (0.5 * a_SM.double() * scale_S.double()[:, None]).T
    expected.index_add_(0, sched.expert_S, torch.einsum("ms,sn->smn", rows, b_SN.double()))
    assert_close(out, expected, "swiglu_experts", torch.float32, "grad", f"split {split_k}")
