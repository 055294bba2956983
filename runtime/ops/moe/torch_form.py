"""Torch form of MoE routing (and the fp32 router logits the runtime layer always computes
in torch) and the routed SwiGLU experts (the dense MLP and shared expert: runtime/ops/mlp/torch_form.py).

The experts sort the (token, choice) pairs by expert and run two grouped matmuls
(torch._grouped_mm where this build and dtype support it, else one matmul per expert),
then put the rows back in pair order and sum each token's k rows.

Shape legend: T tokens, D model width, E experts, F expert width, k top-k, r LoRA rank,
S = T * k (token, choice) pairs, in expert-sorted order where named `_S*`.
Weight layouts are those of reference_ops/moe.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.ops.mlp.torch_form import gated
from runtime.ops.stored_matmul.torch_form import decode, saved_as_codes

# By spec router `scoring` name: logits [T, E] -> scores [T, E]; a package's generated scorings are added when
# it loads (runtime/package_ops.py), so the registry's predicate sees them.
SCORINGS = {
    "softmax": lambda logits_TE: logits_TE.softmax(dim=-1),
    "sigmoid": torch.sigmoid,
}


def _group_mask(choice_TE: torch.Tensor, num_groups: int, topk_groups: int, top2_sum: bool) -> torch.Tensor:
    T, E = choice_TE.shape
    grouped_TGe = choice_TE.view(T, num_groups, E // num_groups)
    if top2_sum:
        group_score_TG = grouped_TGe.topk(2, dim=-1).values.sum(-1)
    else:
        group_score_TG = grouped_TGe.amax(dim=-1)
    best_TG = group_score_TG.topk(topk_groups, dim=-1).indices
    keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, best_TG, True)
    return keep_TG.repeat_interleave(E // num_groups, dim=1)


class _HalfLogitsInFp32(torch.autograd.Function):
    """x [T, D] @ w [E, D]^T with bf16/fp16 operands, fp32 products summed in fp32 and an fp32
    result: the same logits as upcasting both first (the upcast is exact), at tensor-core speed.
    The gradient is rounded to x's dtype for the two backward GEMMs, as any half-precision
    linear's is."""

    @staticmethod
    def forward(ctx, x_TD, w_ED):
        ctx.save_for_backward(x_TD, w_ED)
        return torch.mm(x_TD, w_ED.T, out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, d_logits_TE):
        x_TD, w_ED = ctx.saved_tensors
        g_TE = d_logits_TE.to(x_TD.dtype)
        dx = g_TE @ w_ED if ctx.needs_input_grad[0] else None
        dw = g_TE.T @ x_TD if ctx.needs_input_grad[1] else None
        return dx, dw


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor, b_E: torch.Tensor | None = None) -> torch.Tensor:
    """Router logits [T, E] in fp32 (routing decisions are precision-sensitive). On CUDA with half
    inputs one GEMM with an fp32 output: upcasting x and w and multiplying in fp32 would run
    without tensor cores."""
    half = (torch.bfloat16, torch.float16)
    if x_TD.is_cuda and x_TD.dtype in half and w_ED.dtype == x_TD.dtype:
        logits_TE = _HalfLogitsInFp32.apply(x_TD, w_ED)
        return logits_TE if b_E is None else logits_TE + b_E.float()
    return F.linear(x_TD.float(), w_ED.float(), None if b_E is None else b_E.float())


def route(
    logits_TE: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    norm_topk_prob: bool,
    routed_scaling_factor: float = 1.0,
    correction_bias_E: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    topk_before_softmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router in fp32: logits [T, E] -> (weights_Tk fp32, idx_Tk int64). Same rules as the reference."""
    logits_TE = logits_TE.float()
    if topk_before_softmax:
        top_logits_Tk, idx_Tk = logits_TE.topk(top_k, dim=-1)
        return top_logits_Tk.softmax(dim=-1) * routed_scaling_factor, idx_Tk
    if scoring not in SCORINGS:
        raise ValueError(f"route: scoring must be one of {sorted(SCORINGS)}, got {scoring!r}")
    scores_TE = SCORINGS[scoring](logits_TE)
    choice_TE = scores_TE.detach()
    if correction_bias_E is not None:
        choice_TE = choice_TE + correction_bias_E.float()
    if num_groups > 1:
        top2_sum = scoring == "sigmoid" or correction_bias_E is not None
        keep_TE = _group_mask(choice_TE, num_groups, topk_groups, top2_sum)
        choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
    idx_Tk = choice_TE.topk(top_k, dim=-1).indices
    weights_Tk = scores_TE.gather(1, idx_Tk)
    if norm_topk_prob:
        weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)
    return weights_Tk * routed_scaling_factor, idx_Tk


@dataclass(frozen=True)
class ExpertSort:
    """Pairs sorted by expert: pair_S (index into the T*k pairs), token_S, expert_S, offsets_E (cumulative ends, int32)."""

    pair_S: torch.Tensor
    token_S: torch.Tensor
    expert_S: torch.Tensor
    offsets_E: torch.Tensor


def sort_by_expert(idx_Tk: torch.Tensor, num_experts: int) -> ExpertSort:
    flat_S = idx_Tk.reshape(-1)
    expert_S, pair_S = torch.sort(flat_S, stable=True)
    counts_E = torch.bincount(flat_S, minlength=num_experts)
    offsets_E = torch.cumsum(counts_E, 0).to(torch.int32)
    return ExpertSort(pair_S, pair_S // idx_Tk.shape[1], expert_S, offsets_E)


def _grouped_mm_ok(a_SK: torch.Tensor, w_EKN: torch.Tensor) -> bool:
    # torch._grouped_mm takes fp32/bf16/fp16 on CUDA and, since 2.9, on CPU; its CPU kernel
    # wants 16-byte aligned rows. Its backward on CPU rejects broadcast (stride 0) gradients,
    # which the callers here never produce.
    if not hasattr(torch, "_grouped_mm") or a_SK.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    row_bytes = (a_SK.shape[1] * a_SK.element_size(), w_EKN.shape[2] * w_EKN.element_size())
    return a_SK.dtype == w_EKN.dtype and all(b % 16 == 0 for b in row_bytes)


def grouped_linear(a_SK: torch.Tensor, w_ENK: torch.Tensor, sort: ExpertSort) -> torch.Tensor:
    """Rows of expert e times w[e]^T: [S, K] x [E, N, K] -> [S, N]."""
    w_EKN = w_ENK.transpose(1, 2)
    if _grouped_mm_ok(a_SK, w_EKN):
        return torch._grouped_mm(a_SK, w_EKN, offs=sort.offsets_E)
    ends = sort.offsets_E.tolist()
    starts = [0] + ends[:-1]
    parts = [a_SK[s:e] @ w_EKN[i] for i, (s, e) in enumerate(zip(starts, ends)) if e > s]
    return torch.cat(parts) if parts else a_SK.new_zeros(0, w_ENK.shape[1])


def _lora_linear(a_SK, w_ENK, lora, scale, sort):
    out_SN = grouped_linear(a_SK, w_ENK, sort)
    if lora is None:
        return out_SN
    A_ErK, B_ENr = lora
    return out_SN + scale * grouped_linear(grouped_linear(a_SK, A_ErK, sort), B_ENr, sort)


def glu(gate, up, activation: str, clamp: float | None, glu_alpha: float | None, situ_betas=None):
    """The expert's gated activation; clamp and glu_alpha give the gpt-oss form, situ_betas Kimi K3's SiTU."""
    if clamp is not None:
        gate = gate.clamp(max=clamp)
        up = up.clamp(-clamp, clamp)
    if glu_alpha is not None:
        return gate * torch.sigmoid(glu_alpha * gate) * (up + 1)
    return gated(gate, up, activation, situ_betas)


def swiglu_experts(
    x_TD: torch.Tensor,
    weights_Tk: torch.Tensor,
    idx_Tk: torch.Tensor,
    w_gate_up_E2FD: torch.Tensor,
    w_down_EDF: torch.Tensor,
    *,
    b_gate_up_E2F: torch.Tensor | None = None,
    b_down_ED: torch.Tensor | None = None,
    activation: str = "silu",
    clamp: float | None = None,
    glu_alpha: float | None = None,
    situ_betas: tuple[float, float | None] | None = None,
    interleaved_gate_up: bool = False,
    lora_gate_up: tuple[torch.Tensor, torch.Tensor] | None = None,
    lora_down: tuple[torch.Tensor, torch.Tensor] | None = None,
    lora_scale: float = 1.0,
) -> torch.Tensor:
    """Routed experts, y_TD = sum_j weights[t, j] * expert_{idx[t, j]}(x[t]), in x's dtype."""
    T, k = idx_Tk.shape
    sort = sort_by_expert(idx_Tk, w_gate_up_E2FD.shape[0])
    x_SD = x_TD[sort.token_S]
    gate_up_S2F = _lora_linear(x_SD, w_gate_up_E2FD, lora_gate_up, lora_scale, sort)
    if b_gate_up_E2F is not None:
        gate_up_S2F = gate_up_S2F + b_gate_up_E2F[sort.expert_S]
    if interleaved_gate_up:
        gate_SF, up_SF = gate_up_S2F[:, 0::2], gate_up_S2F[:, 1::2]
    else:
        gate_SF, up_SF = gate_up_S2F.chunk(2, dim=-1)
    h_SF = glu(gate_SF, up_SF, activation, clamp, glu_alpha, situ_betas)
    y_SD = _lora_linear(h_SF, w_down_EDF, lora_down, lora_scale, sort)
    if b_down_ED is not None:
        y_SD = y_SD + b_down_ED[sort.expert_S]
    y_SD = y_SD * weights_Tk.reshape(-1)[sort.pair_S, None].to(y_SD.dtype)
    # Back to pair order, then a sum over each token's k rows: deterministic, unlike index_add_.
    inverse_S = torch.empty_like(sort.pair_S)
    inverse_S[sort.pair_S] = torch.arange(T * k, device=idx_Tk.device)
    return y_SD[inverse_S].view(T, k, -1).sum(dim=1).to(x_TD.dtype)


def stored_swiglu_experts(
    x_TD: torch.Tensor,
    weights_Tk: torch.Tensor,
    idx_Tk: torch.Tensor,
    gate_up_codes: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down_codes: torch.Tensor,
    down_scale: torch.Tensor,
    *,
    kind: str,
    block: tuple[int, int] | None = None,
    **experts_kwargs,
) -> torch.Tensor:
    """swiglu_experts over frozen base weights in their released format (runtime/ops/stored_matmul/README.md): each
    decoded into x's dtype for this layer's matmuls and, where autograd would keep it for the backward, kept as its
    codes and decoded again there. The keywords after `block` are swiglu_experts'."""
    def decoder(codes, scale):
        return lambda: decode(codes, scale, kind, block, x_TD.dtype)

    redo_gu, redo_d = decoder(gate_up_codes, gate_up_scale), decoder(down_codes, down_scale)
    w_gu, w_d = redo_gu(), redo_d()
    with saved_as_codes([(w_gu, redo_gu), (w_d, redo_d)]):
        return swiglu_experts(x_TD, weights_Tk, idx_Tk, w_gu, w_d, **experts_kwargs)
