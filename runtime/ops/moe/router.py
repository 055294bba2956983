"""The router as one Triton pass forward and one backward: top-k of each token's logits and the
softmax over the k picked, times the routed scaling factor.

That form covers softmax scoring with norm_topk_prob (normalizing the k picked probabilities is a
softmax over their logits: the full normalizer cancels) and topk_before_softmax (Mixtral,
gpt-oss). torch's form is a radix top-k in many launches, softmax, gather, sum, divide and
their backward; this reads the logits once.
Other routing rules (sigmoid scoring, unnormalized weights, correction bias, expert groups) use
the torch form. Ties between equal logits go to the lower expert id.

Shape legend: T tokens, E experts, k top-k.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.common.launch import fast
from runtime.ops.common import buffers
from runtime.ops.moe import torch_form as torch_ops


@triton.jit
def topk_softmax_kernel(logits_ptr, stride_t, weights_ptr, idx_ptr, T, E, scale,
                        TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < T
    experts = tl.arange(0, BLOCK_E)
    vals = tl.load(logits_ptr + tokens[:, None].to(tl.int64) * stride_t + experts[None, :],
                   mask=t_ok[:, None] & (experts < E)[None, :], other=float("-inf")).to(tl.float32)
    # rows past T hold finite values, so that their (unstored) softmax stays free of inf - inf
    vals = tl.where(t_ok[:, None], vals, 0.0)
    picks = tl.arange(0, BLOCK_K)
    top_val = tl.full((BLOCK_T, BLOCK_K), float("-inf"), tl.float32)
    top_idx = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(vals, axis=1)
        arg = tl.min(tl.where(vals == best[:, None], experts[None, :], BLOCK_E), axis=1)
        top_val = tl.where(picks[None, :] == j, best[:, None], top_val)
        top_idx = tl.where(picks[None, :] == j, arg[:, None], top_idx)
        vals = tl.where(experts[None, :] == arg[:, None], float("-inf"), vals)
    # pick 0 holds the largest logit; the padding picks (-inf) get weight 0
    exps = tl.exp(top_val - tl.max(top_val, axis=1)[:, None])
    weights = exps / tl.sum(exps, axis=1)[:, None] * scale
    out = tokens[:, None].to(tl.int64) * TOP_K + picks[None, :]
    mask = t_ok[:, None] & (picks < TOP_K)[None, :]
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(idx_ptr + out, top_idx.to(tl.int64), mask=mask)


@triton.jit
def topk_softmax_backward_kernel(dw_ptr, weights_ptr, idx_ptr, dlogits_ptr, stride_t, T, E, inv_scale,
                                 TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                                 BLOCK_K: tl.constexpr):
    """d logit[i_m] = w_m (g_m - sum_j g_j w_j / scale) for the picked experts, 0 elsewhere."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < T
    picks = tl.arange(0, BLOCK_K)
    pick_ok = t_ok[:, None] & (picks < TOP_K)[None, :]
    at = tokens[:, None].to(tl.int64) * TOP_K + picks[None, :]
    g = tl.load(dw_ptr + at, mask=pick_ok, other=0.0).to(tl.float32)
    w = tl.load(weights_ptr + at, mask=pick_ok, other=0.0)
    idx = tl.load(idx_ptr + at, mask=pick_ok, other=-1)
    d_pick = w * (g - tl.sum(g * w, axis=1)[:, None] * inv_scale)
    experts = tl.arange(0, BLOCK_E)
    d_logits = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    for j in tl.static_range(TOP_K):
        idx_j = tl.sum(tl.where(picks[None, :] == j, idx, 0), axis=1)
        d_j = tl.sum(tl.where(picks[None, :] == j, d_pick, 0.0), axis=1)
        d_logits = tl.where(experts[None, :] == idx_j[:, None], d_j[:, None], d_logits)
    tl.store(dlogits_ptr + tokens[:, None].to(tl.int64) * stride_t + experts[None, :],
             d_logits.to(dlogits_ptr.dtype.element_ty), mask=t_ok[:, None] & (experts < E)[None, :])


def _launch(kernel, T: int, E: int, k: int, *args):
    block_e = triton.next_power_of_2(E)
    # about 4096 logits per program: 8 tokens of 512 experts
    block_t = max(1, 4096 // block_e)
    fast(kernel)[(triton.cdiv(T, block_t),)](*args, TOP_K=k, BLOCK_T=block_t, BLOCK_E=block_e,
                                             BLOCK_K=triton.next_power_of_2(k), num_warps=4)


class _TopkSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE, top_k, scale):
        T, E = logits_TE.shape
        weights_Tk = buffers.empty(T, top_k, dtype=torch.float32, device=logits_TE.device)
        idx_Tk = buffers.empty(T, top_k, dtype=torch.int64, device=logits_TE.device)
        _launch(topk_softmax_kernel, T, E, top_k, logits_TE, logits_TE.stride(0), weights_Tk, idx_Tk, T, E, scale)
        ctx.save_for_backward(weights_Tk, idx_Tk)
        ctx.mark_non_differentiable(idx_Tk)
        # no zero-filled gradient for idx (nor for weights when unused): a launch saved
        ctx.set_materialize_grads(False)
        ctx.scale, ctx.shape, ctx.dtype = scale, logits_TE.shape, logits_TE.dtype
        return weights_Tk, idx_Tk

    @staticmethod
    def backward(ctx, dw_Tk, _):
        if dw_Tk is None:
            return None, None, None
        weights_Tk, idx_Tk = ctx.saved_tensors
        T, E = ctx.shape
        d_logits = buffers.empty(T, E, dtype=ctx.dtype, device=weights_Tk.device)
        _launch(topk_softmax_backward_kernel, T, E, idx_Tk.shape[1], dw_Tk.contiguous(), weights_Tk, idx_Tk,
                d_logits, d_logits.stride(0), T, E, 1.0 / ctx.scale)
        return d_logits, None, None


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
    """Router: logits [T, E] -> (weights_Tk fp32, idx_Tk int64), contract of reference_ops/moe.py."""
    plain_softmax_norm = scoring == "softmax" and norm_topk_prob and correction_bias_E is None and num_groups == 1
    if (topk_before_softmax or plain_softmax_norm) and routed_scaling_factor != 0:
        return _TopkSoftmax.apply(logits_TE.contiguous(), top_k, float(routed_scaling_factor))
    return torch_ops.route(logits_TE, top_k, scoring=scoring, norm_topk_prob=norm_topk_prob,
                           routed_scaling_factor=routed_scaling_factor, correction_bias_E=correction_bias_E,
                           num_groups=num_groups, topk_groups=topk_groups, topk_before_softmax=topk_before_softmax)
