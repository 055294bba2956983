"""Routed SwiGLU experts as one autograd op over the fused grouped kernels.

Forward: gate/up grouped GEMM with the GLU in its epilogue, reading x in expert order (a copy
when a weight gradient will read those rows again, else gathered by token); down grouped GEMM
with the routing weight and the scatter to pair order in its epilogue; one pass summing each
token's k rows. Backward: one GEMM gives d(gate/up) and d(routing weight) (GLU backward in the
epilogue), one gives dx (scattered, then summed over k), and the per-expert weight gradients run
only for the tensors that require grad, so frozen experts under LoRA skip them. dy is always
gathered by token: its copy (0.33 ms at T 16384, k 10, D 2048 on an H200) cost more than it saved.
`Tuning` selects the variants under measurement; its defaults are the path measured on 2026-11-29.

Shape legend: T tokens, D model width, E experts, F expert width, k top-k, r LoRA rank,
S = T * k pairs in expert-sorted order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kernels.moe import buffers
from runtime.kernels.moe.combine import sum_k
from runtime.kernels.moe.grouped_gemm import (
    MODE_GLU_BWD,
    MODE_GLU_FWD,
    Glu,
    LowRank,
    Weight,
    grouped_gemm,
)
from runtime.kernels.moe.grouped_wgrad import grouped_wgrad
from runtime.kernels.moe.schedule import Schedule, build_schedule, retiled


@dataclass(frozen=True)
class Tuning:
    """Kernel variants for side-by-side benchmarking (bench/bench_moe.py); every default is off."""

    # h is stored times the routing weight, so the down weight gradient and LoRA-down grads need no
    # row scale (the down bias then takes the weight in the down GEMM's epilogue)
    scaled_h: bool = False
    # the gate/up GEMM writes x's expert-order copy as it reads x, instead of a separate pass
    fused_x_copy: bool = False
    # row tile of the GLU backward GEMM alone (None: the schedule's tile)
    glu_bwd_block_m: int | None = None
    # programs per expert in the two dense weight gradients (1: one reduction per output tile)
    wgrad_split_k: int = 1


@dataclass(frozen=True)
class Rows:
    """Rows in expert-sorted order: row s is data[index[s]], or data[s] when index is None."""

    data: torch.Tensor
    index: torch.Tensor | None

    def materialized(self) -> torch.Tensor:
        return self.data if self.index is None else self.data[self.index.long()]


def _x_in_expert_order(x_TD: torch.Tensor, sched: Schedule, reread: bool) -> Rows:
    # The gate/up GEMM gathers rows as fast as it reads a copy (1.60 vs 1.61 ms on an H200 at
    # T 16384, k 10, D 2048), but the gate/up weight gradient reduces over rows and was 2.33 ms
    # gathered against 1.94 ms on the copy, which itself costs 0.33 ms: copy only for that reader.
    if reread:
        return Rows(x_TD.index_select(0, sched.token_S), None)
    return Rows(x_TD, sched.token_S)


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


def _gate_up(x: Rows, w_gu, b_gu, lora: Lora, sched: Schedule, glu: Glu, h_scale_S=None, x_copy=None):
    """-> (gate_up_S2F pre-activation, h_SF (times h_scale_S when given), xa_Sr or None);
    x_copy [S, D], when given, receives x's rows in expert order."""
    S, two_f, dtype, device = sched.pair_S.numel(), w_gu.shape[1], x.data.dtype, x.data.device
    xa = None
    low_rank = None
    if lora.A_gu_ErD is not None:
        xa = grouped_gemm(x.data, Weight(lora.A_gu_ErD), sched, buffers.empty((S, lora.A_gu_ErD.shape[1]), dtype, device),
                          a_rows=x.index)
        low_rank = LowRank(xa, Weight(lora.B_gu_E2Fr), lora.scale)
    gate_up = buffers.empty((S, two_f), dtype, device)
    h = buffers.empty((S, two_f // 2), dtype, device)
    grouped_gemm(x.data, Weight(w_gu), sched, h, mode=MODE_GLU_FWD, a_rows=x.index, bias_EN=b_gu,
                 low_rank=low_rank, gate_up=gate_up, glu=glu, row_scale_S=h_scale_S, a_copy=x_copy)
    return gate_up, h, xa


def _down(h_SF, w_d, b_d, w_S, lora: Lora, sched: Schedule, k: int, h_scaled: bool):
    """-> (y_TD, ha_Sr or None): the weighted rows land in pair order, then sum over k.
    h_scaled: h_SF already carries the routing weight, which then only the bias still needs."""
    S, D = h_SF.shape[0], w_d.shape[1]
    ha = None
    low_rank = None
    if lora.A_d_ErF is not None:
        ha = grouped_gemm(h_SF, Weight(lora.A_d_ErF), sched, buffers.empty((S, lora.A_d_ErF.shape[1]), h_SF.dtype, h_SF.device))
        low_rank = LowRank(ha, Weight(lora.B_d_EDr), lora.scale)
    y_pairs = buffers.empty((S, D), h_SF.dtype, h_SF.device)
    row_scale_S = w_S if not h_scaled or b_d is not None else None
    grouped_gemm(h_SF, Weight(w_d), sched, y_pairs, out_rows=sched.pair_S, row_scale_S=row_scale_S, bias_EN=b_d,
                 low_rank=low_rank, scale_bias_only=h_scaled and b_d is not None)
    return sum_k(y_pairs, k), ha


_INPUTS = ["x", "weights", "idx", "w_gu", "w_d", "b_gu", "b_d", "A_gu", "B_gu", "A_d", "B_d"]


class _SwigluExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, weights_Tk, idx_Tk, w_gu, w_d, b_gu, b_d, A_gu, B_gu, A_d, B_d, scale, glu, tuning):
        T, k = idx_Tk.shape
        E = w_gu.shape[0]
        sched = build_schedule(idx_Tk, E, _block_m(T * k, E))
        w_S = weights_Tk.reshape(-1)[sched.pair_S.long()].float().contiguous()
        lora = Lora(A_gu, B_gu, A_d, B_d, scale)
        need = dict(zip(_INPUTS, ctx.needs_input_grad))
        # x only feeds the gradients of the gate/up weights and of LoRA's A there
        keep_x = need["w_gu"] or need["A_gu"]
        fuse_copy = keep_x and tuning.fused_x_copy
        x = _x_in_expert_order(x_TD, sched, keep_x and not fuse_copy)
        x_copy = buffers.empty((T * k, x_TD.shape[1]), x_TD.dtype, x_TD.device) if fuse_copy else None
        h_scale_S = w_S if tuning.scaled_h else None
        gate_up, h, xa = _gate_up(x, w_gu, b_gu, lora, sched, glu, h_scale_S, x_copy)
        x = Rows(x_copy, None) if fuse_copy else x
        y_TD, ha = _down(h, w_d, b_d, w_S, lora, sched, k, tuning.scaled_h)
        ctx.save_for_backward(x.data if keep_x else None, w_S, w_gu, w_d, b_d, A_gu, B_gu, A_d, B_d, gate_up, h, xa, ha)
        ctx.sched, ctx.scale, ctx.glu, ctx.k, ctx.x_index = sched, scale, glu, k, x.index
        ctx.tuning = tuning
        ctx.dtypes = {"x": x_TD.dtype, "weights": weights_Tk.dtype, "b_gu": getattr(b_gu, "dtype", None),
                      "b_d": getattr(b_d, "dtype", None)}
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD):
        x_data, w_S, w_gu, w_d, b_d, A_gu, B_gu, A_d, B_d, gate_up, h, xa, ha = ctx.saved_tensors
        need = dict(zip(_INPUTS, ctx.needs_input_grad))
        sched = ctx.sched
        x = Rows(x_data, ctx.x_index)
        dy = Rows(dy_TD.contiguous().to(ctx.dtypes["x"]), sched.token_S)
        lora = Lora(A_gu, B_gu, A_d, B_d, ctx.scale)
        tuning = ctx.tuning
        glu_sched = _own_tiles(sched, tuning.glu_bwd_block_m)
        d_gate_up, dw_S, dyb = _backward_glu(dy, w_d, b_d, w_S, gate_up, lora, glu_sched, ctx.glu, need["weights"])
        lg = None
        if A_gu is not None and (need["x"] or need["A_gu"]):
            lg = _lora_grad_rows(d_gate_up, lora, sched)
        grads = _input_grads(d_gate_up, dw_S, w_gu, lg, lora, sched, ctx.k, need)
        # h (and ha from it) carry the routing weight already when scaled_h is on
        h_scale_S = None if tuning.scaled_h else w_S
        grads |= _weight_grads(x, dy, d_gate_up, w_S, h_scale_S, h, xa, ha, dyb, lg, lora, sched, need,
                               tuning.wgrad_split_k)
        params = dict(w_gu=w_gu, w_d=w_d, A_gu=A_gu, B_gu=B_gu, A_d=A_d, B_d=B_d)
        return (*(_cast(grads.get(n), params.get(n), ctx.dtypes.get(n)) for n in need), None, None, None)


def _own_tiles(sched: Schedule, block_m: int | None) -> Schedule:
    return sched if block_m is None or block_m == sched.block_m else retiled(sched, block_m)


def _backward_glu(dy: Rows, w_d, b_d, w_S, gate_up, lora: Lora, sched: Schedule, glu: Glu, want_dw: bool):
    """-> (d_gate_up_S2F, d(routing weight) per sorted row or None, dy @ B_d per row or None)."""
    S, dtype, device = sched.pair_S.numel(), dy.data.dtype, dy.data.device
    dyb = None
    low_rank = None
    if lora.A_d_ErF is not None:
        dyb = grouped_gemm(dy.data, Weight(lora.B_d_EDr, transposed=True), sched,
                           buffers.empty((S, lora.B_d_EDr.shape[2]), dtype, device), a_rows=dy.index)
        low_rank = LowRank(dyb, Weight(lora.A_d_ErF, transposed=True), lora.scale)
    d_gate_up = buffers.empty(gate_up.shape, dtype, device)
    dw_S = torch.zeros(S, dtype=torch.float32, device=device) if want_dw else None
    grouped_gemm(dy.data, Weight(w_d, transposed=True), sched, d_gate_up, mode=MODE_GLU_BWD, a_rows=dy.index,
                 row_scale_S=w_S, low_rank=low_rank, gate_up=gate_up, dw_S=dw_S, glu=glu)
    if dw_S is not None and b_d is not None:
        dw_S = dw_S + (dy.materialized().float() * b_d[sched.expert_S].float()).sum(-1)
    return d_gate_up, dw_S, dyb


def _cast(grad, like, dtype):
    if grad is None:
        return None
    return grad.to(like.dtype if like is not None else dtype)


def _input_grads(d_gate_up, dw_S, w_gu, lg, lora: Lora, sched: Schedule, k: int, need: dict) -> dict:
    grads = {}
    if dw_S is not None:
        dw_pairs = torch.empty_like(dw_S)
        dw_pairs[sched.pair_S.long()] = dw_S
        grads["weights"] = dw_pairs.view(-1, k)
    if need["x"]:
        low_rank = LowRank(lg, Weight(lora.A_gu_ErD, transposed=True), lora.scale) if lg is not None else None
        dx_pairs = buffers.empty((d_gate_up.shape[0], w_gu.shape[2]), d_gate_up.dtype, d_gate_up.device)
        grouped_gemm(d_gate_up, Weight(w_gu, transposed=True), sched, dx_pairs, out_rows=sched.pair_S, low_rank=low_rank)
        grads["x"] = sum_k(dx_pairs, k)
    return grads


def _weight_grads(x: Rows, dy: Rows, d_gate_up, w_S, h_scale_S, h, xa, ha, dyb, lg, lora: Lora, sched: Schedule,
                  need: dict, split_k: int) -> dict:
    """h_scale_S: the routing weight h and ha still need (None when stored scaled)."""
    s = lora.scale
    grads = {}
    if need["w_gu"]:
        grads["w_gu"] = grouped_wgrad(d_gate_up, x.data, sched, b_rows=x.index, split_k=split_k)
    if need["w_d"]:
        grads["w_d"] = grouped_wgrad(dy.data, h, sched, a_rows=dy.index, row_scale_S=h_scale_S, split_k=split_k)
    if need["b_gu"]:
        grads["b_gu"] = _segment_sum(d_gate_up.float(), sched)
    if need["b_d"]:
        grads["b_d"] = _segment_sum(dy.materialized().float() * w_S[:, None], sched)
    if need["A_gu"]:
        grads["A_gu"] = grouped_wgrad(lg, x.data, sched, b_rows=x.index, alpha=s)
    if need["B_gu"]:
        grads["B_gu"] = grouped_wgrad(d_gate_up, xa, sched, alpha=s)
    if need["A_d"]:
        grads["A_d"] = grouped_wgrad(dyb, h, sched, row_scale_S=h_scale_S, alpha=s)
    if need["B_d"]:
        grads["B_d"] = grouped_wgrad(dy.data, ha, sched, a_rows=dy.index, row_scale_S=h_scale_S, alpha=s)
    return grads


def _lora_grad_rows(d_gate_up, lora: Lora, sched: Schedule) -> torch.Tensor:
    """d_gate_up @ B_gu per sorted row: the rank-r signal reaching A_gu and, through it, x."""
    out = buffers.empty((d_gate_up.shape[0], lora.B_gu_E2Fr.shape[2]), d_gate_up.dtype, d_gate_up.device)
    return grouped_gemm(d_gate_up, Weight(lora.B_gu_E2Fr, transposed=True), sched, out)


def _segment_sum(rows_SN: torch.Tensor, sched: Schedule) -> torch.Tensor:
    out = torch.zeros(sched.num_experts, rows_SN.shape[1], dtype=torch.float32, device=rows_SN.device)
    return out.index_add_(0, sched.expert_S, rows_SN)


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
    tuning: Tuning = Tuning(),
) -> torch.Tensor:
    """Routed experts, y_TD = sum_j weights[t, j] * expert_{idx[t, j]}(x[t]), in x's dtype.
    Contract of reference_ops/moe.py; the kernels implement silu and the gpt-oss GLU only.
    `tuning` picks kernel variants (numerically equivalent; the default is the validated path)."""
    if activation != "silu" and glu_alpha is None:
        raise ValueError(f"swiglu_experts kernel: activation {activation!r} is not fused; use runtime.ops.moe")
    A_gu, B_gu = lora_gate_up if lora_gate_up is not None else (None, None)
    A_d, B_d = lora_down if lora_down is not None else (None, None)
    glu = Glu(interleaved_gate_up, clamp, glu_alpha)
    return _SwigluExperts.apply(x_TD.contiguous(), weights_Tk, idx_Tk, w_gate_up_E2FD, w_down_EDF, b_gate_up_E2F,
                                b_down_ED, A_gu, B_gu, A_d, B_d, float(lora_scale), glu, tuning)
