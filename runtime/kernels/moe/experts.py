"""Routed SwiGLU experts as one autograd op over the fused grouped kernels.

Forward: gate/up grouped GEMM with the GLU in its epilogue, reading x gathered by token (plus a
copy of x in expert order when a weight gradient will read those rows again); down grouped GEMM
with the routing weight and the scatter to pair order in its epilogue; one pass summing each
token's k rows. Backward: one GEMM gives d(gate/up) and d(routing weight) (GLU backward in the
epilogue, the weight gradient added at each row's pair), one gives dx (scattered, then summed
over k), and the per-expert weight gradients run only for the tensors that require grad, so
frozen experts under LoRA skip them. dy is always gathered by token (a copy costs more than it
saves). The routing weights are read in the router's [T * k] order and the token of a sorted row
is pair // k, so neither is permuted.

Shape legend: T tokens, D model width, E experts, F expert width, k top-k, r LoRA rank,
S = T * k pairs in expert-sorted order, P = T * k pairs in the router's order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kernels import buffers
from runtime.kernels.moe.combine import sum_k
from runtime.kernels.moe.gather import gather_tokens
from runtime.kernels.moe.grouped_gemm import (
    MODE_GLU_BWD,
    MODE_GLU_FWD,
    Glu,
    LowRank,
    Weight,
    grouped_gemm,
)
from runtime.kernels.moe.grouped_wgrad import grouped_wgrad, sorted_rows_wgrad
from runtime.kernels.moe.schedule import Schedule, build_schedule, retiled


# Row tile of the GLU backward GEMM: smaller than the schedule's 128 when experts hold a few hundred
# rows each, as tiles are padded per expert (the schedule's own tile is _block_m's).
GLU_BWD_BLOCK_M = 64


@dataclass(frozen=True)
class Rows:
    """A GEMM operand's rows: data[pair(s) // k] for sorted row s when by_token, else data[s]."""

    data: torch.Tensor
    by_token: bool


def _x_rows(x_TD: torch.Tensor, sched: Schedule, reread: bool) -> Rows:
    # The gate/up GEMM gathers rows as fast as it reads a copy, but the gate/up weight gradient
    # reduces over rows and runs faster on a copy in expert order: copy only for that reader.
    if reread:
        return Rows(gather_tokens(x_TD, sched), False)
    return Rows(x_TD, True)


@dataclass(frozen=True)
class Lora:
    """LoRA pairs of the two projections (None when absent) and their common scale."""

    A_gu_ErD: torch.Tensor | None
    B_gu_E2Fr: torch.Tensor | None
    A_d_ErF: torch.Tensor | None
    B_d_EDr: torch.Tensor | None
    scale: float


def _block_m(num_rows: int, num_experts: int) -> int:
    # Row tiles are padded per expert: with few rows per expert, smaller tiles waste less.
    return 64 if num_rows < 128 * num_experts else 128


def _gate_up(x: Rows, w_gu, b_gu, lora: Lora, sched: Schedule, glu: Glu):
    """-> (gate_up_S2F pre-activation, h_SF, xa_Sr or None)."""
    S, two_f, dtype, device = sched.pair_S.numel(), w_gu.shape[1], x.data.dtype, x.data.device
    xa = None
    low_rank = None
    if lora.A_gu_ErD is not None:
        xa = grouped_gemm(x.data, Weight(lora.A_gu_ErD), sched,
                          buffers.empty(S, lora.A_gu_ErD.shape[1], dtype=dtype, device=device), gather_a=x.by_token)
        low_rank = LowRank(xa, Weight(lora.B_gu_E2Fr), lora.scale)
    gate_up = buffers.empty(S, two_f, dtype=dtype, device=device)
    h = buffers.empty(S, two_f // 2, dtype=dtype, device=device)
    grouped_gemm(x.data, Weight(w_gu), sched, h, mode=MODE_GLU_FWD, gather_a=x.by_token, bias_EN=b_gu,
                 low_rank=low_rank, gate_up=gate_up, glu=glu)
    return gate_up, h, xa


def _down(h_SF, w_d, b_d, w_P, lora: Lora, sched: Schedule):
    """-> (y_TD, ha_Sr or None): the weighted rows land in pair order, then sum over k."""
    S, D = h_SF.shape[0], w_d.shape[1]
    ha = None
    low_rank = None
    if lora.A_d_ErF is not None:
        ha = grouped_gemm(h_SF, Weight(lora.A_d_ErF), sched,
                          buffers.empty(S, lora.A_d_ErF.shape[1], dtype=h_SF.dtype, device=h_SF.device))
        low_rank = LowRank(ha, Weight(lora.B_d_EDr), lora.scale)
    y_pairs = buffers.empty(S, D, dtype=h_SF.dtype, device=h_SF.device)
    grouped_gemm(h_SF, Weight(w_d), sched, y_pairs, scatter_out=True, row_scale_P=w_P, bias_EN=b_d, low_rank=low_rank)
    return sum_k(y_pairs, sched.top_k), ha


_INPUTS = ["x", "weights", "idx", "w_gu", "w_d", "b_gu", "b_d", "A_gu", "B_gu", "A_d", "B_d"]


class _SwigluExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, weights_Tk, idx_Tk, w_gu, w_d, b_gu, b_d, A_gu, B_gu, A_d, B_d, scale, glu):
        T, k = idx_Tk.shape
        E = w_gu.shape[0]
        sched = build_schedule(idx_Tk, E, _block_m(T * k, E))
        w_P = weights_Tk.reshape(-1).contiguous()
        lora = Lora(A_gu, B_gu, A_d, B_d, scale)
        need = dict(zip(_INPUTS, ctx.needs_input_grad))
        # x only feeds the gradients of the gate/up weights and of LoRA's A there
        keep_x = need["w_gu"] or need["A_gu"]
        x = _x_rows(x_TD, sched, keep_x)
        gate_up, h, xa = _gate_up(x, w_gu, b_gu, lora, sched, glu)
        y_TD, ha = _down(h, w_d, b_d, w_P, lora, sched)
        ctx.save_for_backward(x.data if keep_x else None, w_P, idx_Tk, w_gu, w_d, b_d, A_gu, B_gu, A_d, B_d,
                              gate_up, h, xa, ha)
        ctx.sched, ctx.scale, ctx.glu, ctx.x_by_token = sched, scale, glu, x.by_token
        ctx.dtypes = {"x": x_TD.dtype, "weights": weights_Tk.dtype, "b_gu": getattr(b_gu, "dtype", None),
                      "b_d": getattr(b_d, "dtype", None)}
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD):
        x_data, w_P, idx_Tk, w_gu, w_d, b_d, A_gu, B_gu, A_d, B_d, gate_up, h, xa, ha = ctx.saved_tensors
        need = dict(zip(_INPUTS, ctx.needs_input_grad))
        sched = ctx.sched
        x = Rows(x_data, ctx.x_by_token)
        dy = Rows(dy_TD.contiguous().to(ctx.dtypes["x"]), True)
        lora = Lora(A_gu, B_gu, A_d, B_d, ctx.scale)
        glu_sched = _own_tiles(sched, GLU_BWD_BLOCK_M)
        d_gate_up, dw_P, dyb = _backward_glu(dy, w_d, w_P, gate_up, lora, glu_sched, ctx.glu, need["weights"])
        lg = None
        if A_gu is not None and (need["x"] or need["A_gu"]):
            lg = _lora_grad_rows(d_gate_up, lora, sched)
        grads = _input_grads(d_gate_up, dw_P, w_gu, b_d, dy.data, idx_Tk, lg, lora, sched, need)
        grads |= _weight_grads(x, dy, d_gate_up, w_P, idx_Tk, h, xa, ha, dyb, lg, lora, sched, need)
        params = dict(w_gu=w_gu, w_d=w_d, A_gu=A_gu, B_gu=B_gu, A_d=A_d, B_d=B_d)
        return (*(_cast(grads.get(n), params.get(n), ctx.dtypes.get(n)) for n in need), None, None)


def _own_tiles(sched: Schedule, block_m: int) -> Schedule:
    return sched if block_m == sched.block_m else retiled(sched, block_m)


def _backward_glu(dy: Rows, w_d, w_P, gate_up, lora: Lora, sched: Schedule, glu: Glu, want_dw: bool):
    """-> (d_gate_up_S2F, d(routing weight) in pair order [T * k] or None, dy @ B_d per row or None)."""
    S, dtype, device = sched.pair_S.numel(), dy.data.dtype, dy.data.device
    dyb = None
    low_rank = None
    if lora.A_d_ErF is not None:
        dyb = grouped_gemm(dy.data, Weight(lora.B_d_EDr, transposed=True), sched,
                           buffers.empty(S, lora.B_d_EDr.shape[2], dtype=dtype, device=device), gather_a=dy.by_token)
        low_rank = LowRank(dyb, Weight(lora.A_d_ErF, transposed=True), lora.scale)
    d_gate_up = buffers.empty(gate_up.shape, dtype=dtype, device=device)
    # the kernel adds one partial sum per column tile into each pair's entry
    dw_P = torch.zeros(S, dtype=torch.float32, device=device) if want_dw else None
    grouped_gemm(dy.data, Weight(w_d, transposed=True), sched, d_gate_up, mode=MODE_GLU_BWD, gather_a=dy.by_token,
                 row_scale_P=w_P, low_rank=low_rank, gate_up=gate_up, dw_P=dw_P, glu=glu)
    return d_gate_up, dw_P, dyb


def _cast(grad, like, dtype):
    if grad is None:
        return None
    return grad.to(like.dtype if like is not None else dtype)


def _input_grads(d_gate_up, dw_P, w_gu, b_d, dy_TD, idx_Tk, lg, lora: Lora, sched: Schedule, need: dict) -> dict:
    grads = {}
    k = sched.top_k
    if dw_P is not None:
        dw_Tk = dw_P.view(-1, k)
        if b_d is not None:
            # the down bias is scaled by the routing weight too: d w[t, j] += dy[t] . b_d[idx[t, j]]
            dw_Tk = dw_Tk + (dy_TD.float() @ b_d.float().T).gather(1, idx_Tk)
        grads["weights"] = dw_Tk
    if need["x"]:
        low_rank = LowRank(lg, Weight(lora.A_gu_ErD, transposed=True), lora.scale) if lg is not None else None
        dx_pairs = buffers.empty(d_gate_up.shape[0], w_gu.shape[2], dtype=d_gate_up.dtype, device=d_gate_up.device)
        grouped_gemm(d_gate_up, Weight(w_gu, transposed=True), sched, dx_pairs, scatter_out=True, low_rank=low_rank)
        grads["x"] = sum_k(dx_pairs, k)
    return grads


def _weight_grads(x: Rows, dy: Rows, d_gate_up, w_P, idx_Tk, h, xa, ha, dyb, lg, lora: Lora, sched: Schedule,
                  need: dict) -> dict:
    """h takes the routing weight w as a row scale in the down-side gradients."""
    s = lora.scale
    grads = {}
    if need["w_gu"]:
        grads["w_gu"] = _gate_up_wgrad(d_gate_up, x, sched)
    if need["w_d"]:
        grads["w_d"] = grouped_wgrad(dy.data, h, sched, gather_a=dy.by_token, row_scale_P=w_P)
    if need["b_gu"]:
        grads["b_gu"] = _segment_sum(d_gate_up.float(), sched)
    if need["b_d"]:
        grads["b_d"] = _routed_sum(dy.data.float(), w_P, idx_Tk, sched.num_experts)
    if need["A_gu"]:
        grads["A_gu"] = grouped_wgrad(lg, x.data, sched, gather_b=x.by_token, alpha=s)
    if need["B_gu"]:
        grads["B_gu"] = grouped_wgrad(d_gate_up, xa, sched, alpha=s)
    if need["A_d"]:
        grads["A_d"] = grouped_wgrad(dyb, h, sched, row_scale_P=w_P, alpha=s)
    if need["B_d"]:
        grads["B_d"] = grouped_wgrad(dy.data, ha, sched, gather_a=dy.by_token, row_scale_P=w_P, alpha=s)
    return grads


def _gate_up_wgrad(d_gate_up, x: Rows, sched: Schedule) -> torch.Tensor:
    """x's rows are the copy in expert order here (_x_rows): torch._grouped_mm where it takes them."""
    grad = sorted_rows_wgrad(d_gate_up, x.data, sched)
    return grad if grad is not None else grouped_wgrad(d_gate_up, x.data, sched)


def _lora_grad_rows(d_gate_up, lora: Lora, sched: Schedule) -> torch.Tensor:
    """d_gate_up @ B_gu per sorted row: the rank-r signal reaching A_gu and, through it, x."""
    out = buffers.empty(d_gate_up.shape[0], lora.B_gu_E2Fr.shape[2], dtype=d_gate_up.dtype, device=d_gate_up.device)
    return grouped_gemm(d_gate_up, Weight(lora.B_gu_E2Fr, transposed=True), sched, out)


def _segment_sum(rows_SN: torch.Tensor, sched: Schedule) -> torch.Tensor:
    out = torch.zeros(sched.num_experts, rows_SN.shape[1], dtype=torch.float32, device=rows_SN.device)
    return out.index_add_(0, sched.expert_S, rows_SN)


def _routed_sum(rows_TN: torch.Tensor, w_P: torch.Tensor, idx_Tk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E, N]: sum over pairs (t, j) routed to e of w[t, j] * rows[t], as (routing matrix)^T @ rows."""
    route_TE = torch.zeros(rows_TN.shape[0], num_experts, dtype=torch.float32, device=rows_TN.device)
    route_TE.scatter_add_(1, idx_Tk, w_P.view(idx_Tk.shape).float())
    return route_TE.T @ rows_TN


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
    interleaved_gate_up: bool = False,
    lora_gate_up: tuple[torch.Tensor, torch.Tensor] | None = None,
    lora_down: tuple[torch.Tensor, torch.Tensor] | None = None,
    lora_scale: float = 1.0,
) -> torch.Tensor:
    """Routed experts, y_TD = sum_j weights[t, j] * expert_{idx[t, j]}(x[t]), in x's dtype.
    Contract of reference_ops/moe.py; the kernels implement silu and the gpt-oss GLU only."""
    if activation != "silu" and glu_alpha is None:
        raise ValueError(f"swiglu_experts kernel: activation {activation!r} is not fused; use runtime.ops.moe")
    A_gu, B_gu = lora_gate_up if lora_gate_up is not None else (None, None)
    A_d, B_d = lora_down if lora_down is not None else (None, None)
    glu = Glu(interleaved_gate_up, clamp, glu_alpha)
    return _SwigluExperts.apply(x_TD.contiguous(), weights_Tk, idx_Tk, w_gate_up_E2FD, w_down_EDF, b_gate_up_E2F,
                                b_down_ED, A_gu, B_gu, A_d, B_d, float(lora_scale), glu)
