"""MoE Triton kernels under TRITON_INTERPRET=1 vs the fp64 reference: the router (top-k and the
softmax over the k picked, forward and logit gradient; other rules run the torch form), routed
SwiGLU experts forward and every gradient (x, routing weights, expert weights, biases, LoRA A/B),
with NaN-prefilled buffers, x read from a copy in expert order and gathered by token, an expert
that receives no tokens, an expert count divisible by nothing convenient, the gpt-oss GLU (clamp,
alpha, interleaved gate/up, transposed weight views), frozen experts, and the GLU backward on row
tiles of its own; the half-precision router logits' dtypes. The dense MLP: test_kernel_mlp.py.

Shape legend: T tokens, D model width, E experts, F expert width, k top-k, r LoRA rank.
fp32 inputs: under the interpreter a tl.dot on bf16 operands is wrong in triton 3.9.
"""
import pytest
import torch

from reference_ops import moe as ref
from runtime.ops.moe import kernel as kernels
from runtime.ops.moe import experts, grouped_wgrad, router, schedule, token_rows
from runtime.ops.moe import torch_form as torch_ops
from runtime.tolerances import assert_close
from tests.opcheck import check_route

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("nan_buffers")]

T, D, F_EXPERT = 37, 32, 16


def _routing(E, k, empty_expert, seed, num_tokens=T):
    g = torch.Generator().manual_seed(seed)
    choices = torch.tensor([e for e in range(E) if e != empty_expert])
    idx = torch.stack([choices[torch.randperm(len(choices), generator=g)[:k]] for _ in range(num_tokens)])
    return idx, torch.rand(num_tokens, k, generator=g) + 0.1


def _problem(E=6, k=2, empty_expert=None, bias=False, lora_rank=0, transposed=False, seed=0, num_tokens=T):
    """Leaves (name -> fp32 tensor) and the index; gpt-oss stores its experts transposed."""
    torch.manual_seed(seed)
    idx, weights = _routing(E, k, empty_expert, seed, num_tokens)
    leaves = {"x_TD": torch.randn(num_tokens, D), "weights_Tk": weights,
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


def check_experts(leaves, idx, frozen=(), **static):
    """Kernel (fp32) vs reference (fp64): output and the gradient of every leaf not in `frozen`."""
    run_in = {n: t.detach().requires_grad_(n not in frozen) for n, t in leaves.items()}
    ref_in = {n: t.detach().double().requires_grad_(n not in frozen) for n, t in leaves.items()}
    out = _call(kernels.swiglu_experts, run_in, idx, **static)
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
    # 150 rows per expert: two of the schedule's 128-row tiles each, the second partial
    "T300-E2-k1-schedule-tile-128": dict(E=2, k=1, seed=7, num_tokens=300),
}


@pytest.mark.parametrize("case", list(CASES))
def test_experts_match_reference(case):
    leaves, idx = _problem(**CASES[case])
    check_experts(leaves, idx)


def test_gpt_oss_glu_with_biases_and_transposed_weights():
    leaves, idx = _problem(E=5, bias=True, transposed=True, seed=3)
    # 1.5 is inside the spread of gate/up here, so both sides of the clamp are exercised
    check_experts(leaves, idx, clamp=1.5, glu_alpha=1.702, interleaved_gate_up=True)


SITU_CASES = {
    # Kimi K3's released betas; caps the pre-activations here (std ~1.7) saturate, with LoRA and an empty expert;
    # the up projection left uncapped (no linear_beta)
    "k3-betas": dict(problem=dict(seed=9), betas=(4.0, 25.0)),
    "saturating-lora-empty-expert": dict(problem=dict(E=7, k=3, empty_expert=4, lora_rank=3, seed=10),
                                         betas=(1.0, 0.5), static=dict(lora_scale=0.5)),
    "up-uncapped-frozen": dict(problem=dict(E=5, seed=11), betas=(0.7, None),
                               frozen=("w_gate_up_E2FD", "w_down_EDF")),
}


@pytest.mark.parametrize("case", list(SITU_CASES))
def test_situ_glu_in_the_epilogue_matches_reference(case, monkeypatch):
    """SiTU-GLU runs in the grouped GEMM's epilogue and the GLU backward pass, not through the torch form."""
    spec = SITU_CASES[case]
    leaves, idx = _problem(**spec["problem"])
    monkeypatch.setattr(experts.torch_ops, "swiglu_experts", None)
    check_experts(leaves, idx, frozen=spec.get("frozen", ()), activation="situ", situ_betas=spec["betas"],
                  **spec.get("static", {}))


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
    out = token_rows.sum_k(rows_SD, 3)
    assert_close(out, rows_SD.double().view(5, 3, 1100).sum(1), "swiglu_experts", torch.float32, "out")


@pytest.mark.parametrize("E,k,empty,block_m", [(7, 3, 4, 16), (600, 2, 5, 16)],
                         ids=["E7-k3", "E600-k2-many-tile-blocks"])
def test_schedule_covers_every_row_once(E, k, empty, block_m):
    idx, _ = _routing(E, k, empty, seed=7)
    sched = schedule.build_schedule(idx, E, block_m=block_m)
    assert torch.equal(sched.ends_E.long(), torch.searchsorted(sched.expert_S.long(), torch.arange(E), right=True))
    # the narrow sort keys give the int64 ids' stable order
    assert torch.equal(sched.pair_S, torch.sort(idx.reshape(-1), stable=True).indices)
    covered = torch.zeros(idx.numel(), dtype=torch.int64)
    for e, start in zip(sched.tile_expert.tolist(), sched.tile_start.tolist()):
        if e < E:
            end = min(start + block_m, int(sched.ends_E[e]))
            assert (sched.expert_S[start:end] == e).all()
            covered[start:end] += 1
    assert (covered == 1).all()
    assert torch.equal(torch.sort(sched.pair_S).values, torch.arange(idx.numel()))


GPT_OSS = dict(clamp=1.5, glu_alpha=1.702, interleaved_gate_up=True)
SMALL_TILE_PROBLEMS = {
    "E7-k3-empty-expert": (dict(E=7, k=3, empty_expert=4), (), {}),
    "lora-gpt-oss-biases": (dict(E=6, bias=True, lora_rank=3, seed=6), (), dict(lora_scale=2.0, **GPT_OSS)),
    "lora-frozen-base": (dict(E=7, empty_expert=1, lora_rank=4, seed=5), ("w_gate_up_E2FD", "w_down_EDF"),
                         dict(lora_scale=0.5)),
}


@pytest.mark.parametrize("problem", list(SMALL_TILE_PROBLEMS))
def test_experts_over_several_row_tiles_each(problem, monkeypatch):
    """16-row tiles, which cut the larger experts into two or three tiles (the last partial) in every GEMM mode,
    LoRA and the gpt-oss GLU included, at interpreter-sized problems."""
    monkeypatch.setattr(experts, "BLOCK_M", 16)
    shape, frozen, static = SMALL_TILE_PROBLEMS[problem]
    leaves, idx = _problem(**shape)
    check_experts(leaves, idx, frozen=frozen, **static)


def test_sorted_rows_wgrad_per_expert_and_the_strides_it_declines():
    """torch._grouped_mm's per-expert a^T b over the sorted rows (the default gate/up weight gradient): against an
    fp64 sum per expert, an expert with no rows exactly zero; None (grouped_wgrad then runs) where a row stride is
    no multiple of 16 bytes."""
    idx, _ = _routing(7, 3, 4, seed=11)
    sched = schedule.build_schedule(idx, 7, block_m=16)
    S = idx.numel()
    a, b = torch.randn(S, 8), torch.randn(S, 12)
    got = grouped_wgrad.sorted_rows_wgrad(a, b, sched)
    expected = torch.zeros(7, 8, 12, dtype=torch.float64).index_add_(
        0, sched.expert_S.long(), a.double()[:, :, None] * b.double()[:, None, :])
    assert torch.equal(got[4], torch.zeros_like(got[4]))
    assert_close(got, expected, "swiglu_experts", torch.float32, "grad", "w_gu")
    # 6 fp32 per row: 24 bytes
    assert grouped_wgrad.sorted_rows_wgrad(a, torch.randn(S, 6), sched) is None


def test_gather_tokens_writes_every_sorted_row():
    idx, _ = _routing(7, 3, 4, seed=9)
    sched = schedule.build_schedule(idx, 7, block_m=16)
    # D 1100 spans two 1024-wide column blocks, the second one masked
    x_TD = torch.randn(T, 1100)
    assert torch.equal(token_rows.gather_tokens(x_TD, sched), x_TD[sched.pair_S // 3])
    # scaled by each sorted row's routing weight, read at its pair (the down weight gradient's dy rows)
    w_P = torch.rand(idx.numel())
    scaled = token_rows.gather_tokens(x_TD, sched, row_scale_P=w_P)
    assert torch.equal(scaled, x_TD[sched.pair_S // 3] * w_P[sched.pair_S][:, None])


ROUTER_CASES = {
    "softmax-norm-E20-k4": (20, 4, dict(norm_topk_prob=True)),
    "softmax-norm-scaled-E512-k10": (512, 10, dict(norm_topk_prob=True, routed_scaling_factor=2.5)),
    "topk-before-softmax-E7-k2": (7, 2, dict(norm_topk_prob=False, topk_before_softmax=True)),
}


@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_fused_router_matches_reference(case, monkeypatch):
    E, k, kwargs = ROUTER_CASES[case]
    monkeypatch.setattr(router.torch_ops, "route", lambda *a, **kw: pytest.fail("ran the torch router"))
    torch.manual_seed(11)
    check_route(kernels.route, ref.route, torch.randn(63, E), k, case, **kwargs)


def test_router_rules_without_a_fused_form_use_torch():
    torch.manual_seed(12)
    logits = torch.randn(63, 12)
    for kwargs in (dict(norm_topk_prob=False), dict(scoring="sigmoid", norm_topk_prob=True),
                   dict(norm_topk_prob=True, num_groups=4, topk_groups=2)):
        w_run, idx_run = kernels.route(logits, 3, **kwargs)
        w_ref, idx_ref = ref.route(logits.double(), 3, **kwargs)
        assert torch.equal(idx_run, idx_ref)
        assert_close(w_run, w_ref, "route", torch.float32, "out", str(kwargs))


def test_half_router_logits_keep_fp32_and_give_half_grads():
    # mm with an fp32 output has no CPU kernel: shapes and dtypes on the meta device
    x = torch.empty(5, 8, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(3, 8, dtype=torch.bfloat16, device="meta", requires_grad=True)
    logits = torch_ops._HalfLogitsInFp32.apply(x, w)
    assert logits.dtype == torch.float32 and logits.shape == (5, 3)
    logits.backward(torch.empty(5, 3, device="meta"))
    assert (x.grad.dtype, x.grad.shape) == (torch.bfloat16, x.shape)
    assert (w.grad.dtype, w.grad.shape) == (torch.bfloat16, w.shape)


def test_experts_kernel_runs_an_unfused_activation_through_the_torch_path():
    """A package's generated activation reaches the kernel entry point on CUDA: it must compute, not refuse."""
    leaves, idx = _problem(bias=True, lora_rank=2)
    ours = _call(kernels.swiglu_experts, leaves, idx, activation="gelu")
    torch.testing.assert_close(ours, _call(torch_ops.swiglu_experts, leaves, idx, activation="gelu"), rtol=0, atol=0)
