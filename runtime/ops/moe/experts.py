"""Routed SwiGLU experts as one autograd op over the fused grouped kernels.

Forward: gate/up grouped GEMM with the GLU in its epilogue, reading x gathered by token (plus a copy of x in
expert order when a weight gradient will read those rows again and cannot gather them itself: on Hopper written by
the Gluon kernel of gluon/glu_gemm.py from the rows it gathers, where it applies); down grouped GEMM with the routing
weight and the scatter to pair order in its epilogue (on Hopper the Gluon kernel of gluon/down_gemm.py where it
applies); one pass summing each token's k rows. Backward: one GEMM gives dy @ W_down per sorted row, one pass over those
rows the GLU backward (d(gate/up) and d(routing weight), glu_backward.py), one GEMM dx (scattered, then summed
over k), and the per-expert weight gradients run only for the tensors that require grad, so frozen experts
under LoRA skip them. The GEMMs read dy gathered by token, and so do the Gluon weight gradients on Hopper (x's
rows too, gluon/weight_grad.py); elsewhere the weight gradients read copies in expert order (dy's scaled by the routing
weight) for torch._grouped_mm. The routing weights are read in the router's [T * k] order and the token of a
sorted row is pair // k, so neither is permuted.

Shape legend: T tokens, D model width, E experts, F expert width, k top-k, r LoRA rank,
S = T * k pairs in expert-sorted order, P = T * k pairs in the router's order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.ops.common import buffers
from runtime.ops.moe import torch_form as torch_ops
from runtime.ops.moe.token_rows import gather_tokens, sum_k
from runtime.ops.moe.grouped_gemm import (
    MODE_GLU_FWD,
    Glu,
    LowRank,
    Stored,
    Weight,
    grouped_gemm,
)
from runtime.ops.moe.gluon import down_gemm as gluon_down, glu_gemm as gluon_glu, weight_grad as gluon_wgrad
from runtime.ops.mlp.torch_form import SITU
from runtime.ops.moe.glu_backward import routed_glu_backward
from runtime.ops.moe.grouped_wgrad import grouped_mm_takes, grouped_wgrad, sorted_rows_wgrad
from runtime.ops.moe.schedule import Schedule, build_schedule
from runtime.ops.stored_matmul.torch_form import stored_operands


# Row tile of every grouped GEMM. Tiles are padded per expert, so smaller ones waste fewer rows, but 128 rows beat
# 64 both at ~80 rows per expert (4096 tokens, where 64 also reads every expert's weights twice) and at ~320
# (16384 tokens), for the GLU backward too.
BLOCK_M = 128


@dataclass(frozen=True)
class Rows:
    """A GEMM operand's rows: data[pair(s) // k] for sorted row s when by_token, else data[s]."""

    data: torch.Tensor
    by_token: bool


@dataclass(frozen=True)
class BaseWeights:
    """The experts' two base weights as the GEMMs read them: plain [E, 2F, D] and [E, D, F] tensors, or frozen codes
    with their scales in a released format (`stored`: kind and block; then the Gluon kernels, which read bf16, stand
    aside)."""

    w_gu: torch.Tensor
    w_d: torch.Tensor
    s_gu: torch.Tensor | None = None
    s_d: torch.Tensor | None = None
    stored: tuple[str, tuple[int, int] | None] | None = None

    def gate_up(self, transposed: bool = False) -> Weight:
        return self._weight(self.w_gu, self.s_gu, transposed)

    def down(self, transposed: bool = False) -> Weight:
        return self._weight(self.w_d, self.s_d, transposed)

    def _weight(self, data, scale, transposed: bool) -> Weight:
        if self.stored is None:
            return Weight(data, transposed)
        return Weight(data, transposed, Stored(scale, *self.stored))


@dataclass(frozen=True)
class Lora:
    """LoRA pairs of the two projections (None when absent) and their common scale."""

    A_gu_ErD: torch.Tensor | None
    B_gu_E2Fr: torch.Tensor | None
    A_d_ErF: torch.Tensor | None
    B_d_EDr: torch.Tensor | None
    scale: float


def _gate_up(x_TD, keep_x: bool, base: BaseWeights, b_gu, lora: Lora, sched: Schedule, glu: Glu):
    """-> (x's rows for the backward: a copy in expert order when keep_x, gate_up_S2F pre-activation, h_SF,
    xa_Sr or None)."""
    w_gu = base.w_gu
    S, two_f, dtype, device = sched.pair_S.numel(), w_gu.shape[1], x_TD.dtype, x_TD.device
    gate_up = buffers.empty(S, two_f, dtype=dtype, device=device)
    h = buffers.empty(S, two_f // 2, dtype=dtype, device=device)
    # the Gluon kernel on Hopper where it takes the shapes, and compiles (gluon/glu_gemm.py): it writes the copy of x
    # from the rows it gathers
    if (base.stored is None and b_gu is None and lora.A_gu_ErD is None and glu == Glu()
            and gluon_glu.fits(x_TD, w_gu, sched.block_m)):
        x_sorted = buffers.empty(S, x_TD.shape[1], dtype=dtype, device=device) if keep_x else None
        if gluon_glu.glu_gemm(x_TD, w_gu, sched, gate_up, h, x_sorted):
            return (Rows(x_sorted, False) if keep_x else Rows(x_TD, True)), gate_up, h, None
    x = Rows(gather_tokens(x_TD, sched), False) if keep_x else Rows(x_TD, True)
    xa, low_rank = _low_rank(x, lora.A_gu_ErD, lora.B_gu_E2Fr, lora.scale, sched)
    grouped_gemm(x.data, base.gate_up(), sched, h, mode=MODE_GLU_FWD, gather_a=x.by_token, bias_EN=b_gu,
                 low_rank=low_rank, gate_up=gate_up, glu=glu)
    return x, gate_up, h, xa


def _down(h_SF, base: BaseWeights, b_d, w_P, lora: Lora, sched: Schedule):
    """-> (y_TD, ha_Sr or None): the weighted rows land in pair order, then sum over k."""
    w_d = base.w_d
    S, D = h_SF.shape[0], w_d.shape[1]
    ha, low_rank = _low_rank(Rows(h_SF, False), lora.A_d_ErF, lora.B_d_EDr, lora.scale, sched)
    y_pairs = buffers.empty(S, D, dtype=h_SF.dtype, device=h_SF.device)
    # the Gluon kernel on Hopper where it takes the shapes, and compiles (gluon/down_gemm.py)
    gluon_done = (base.stored is None and b_d is None and low_rank is None
                  and gluon_down.fits(h_SF, w_d, y_pairs, sched.block_m)
                  and gluon_down.down_gemm(h_SF, w_d, sched, y_pairs, w_P))
    if not gluon_done:
        grouped_gemm(h_SF, base.down(), sched, y_pairs, scatter_out=True, row_scale_P=w_P, bias_EN=b_d,
                     low_rank=low_rank)
    return sum_k(y_pairs, sched.top_k), ha


# s_gu, s_d: the scales of stored base weights (None for plain ones), frozen as the codes in w_gu, w_d are
_INPUTS = ["x", "weights", "idx", "w_gu", "w_d", "b_gu", "b_d", "A_gu", "B_gu", "A_d", "B_d", "s_gu", "s_d"]


class _SwigluExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scale, glu, stored, *inputs):
        x_TD, weights_Tk, idx_Tk, w_gu, w_d, b_gu, b_d, A_gu, B_gu, A_d, B_d, s_gu, s_d = inputs
        base = BaseWeights(w_gu, w_d, s_gu, s_d, stored)
        T, k = idx_Tk.shape
        E = w_gu.shape[0]
        sched = build_schedule(idx_Tk, E, BLOCK_M)
        w_P = weights_Tk.reshape(-1).contiguous()
        lora = Lora(A_gu, B_gu, A_d, B_d, scale)
        need = dict(zip(_INPUTS, ctx.needs_input_grad[3:]))
        # The gate/up GEMM gathers x's rows by token as fast as it reads a copy, but the gradients of
        # the gate/up weights and of LoRA's A there reduce over x's rows and run faster on a copy in
        # expert order: copy only for those readers, and not for the gate/up weights' where the Gluon
        # kernel gathers x's rows itself.
        wgu_by_token = need["w_gu"] and gluon_wgrad.takes(x_TD, w_gu.shape[1])
        keep_x = (need["w_gu"] and not wgu_by_token) or need["A_gu"]
        x, gate_up, h, xa = _gate_up(x_TD, keep_x, base, b_gu, lora, sched, glu)
        y_TD, ha = _down(h, base, b_d, w_P, lora, sched)
        # x's rows for the weight gradients: the copy, or x itself where they read it by token
        x_saved = x.data if need["w_gu"] or need["A_gu"] else None
        ctx.save_for_backward(x_saved, w_P, idx_Tk, w_gu, w_d, b_d, A_gu, B_gu, A_d, B_d, gate_up, h, xa, ha, s_gu, s_d)
        ctx.sched, ctx.scale, ctx.glu, ctx.x_by_token, ctx.stored = sched, scale, glu, x.by_token, stored
        ctx.dtypes = {n: t.dtype for n, t in zip(_INPUTS, inputs) if t is not None}
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD):
        x_data, w_P, idx_Tk, w_gu, w_d, b_d, A_gu, B_gu, A_d, B_d, gate_up, h, xa, ha, s_gu, s_d = ctx.saved_tensors
        need = dict(zip(_INPUTS, ctx.needs_input_grad[3:]))
        base = BaseWeights(w_gu, w_d, s_gu, s_d, ctx.stored)
        sched = ctx.sched
        x = Rows(x_data, ctx.x_by_token)
        dy = Rows(dy_TD.contiguous().to(ctx.dtypes["x"]), True)
        lora = Lora(A_gu, B_gu, A_d, B_d, ctx.scale)
        # the down weight gradient in Gluon reads dy by token against the rows w * h, which the GLU pass writes
        wh_for_wd = need["w_d"] and gluon_wgrad.fits(dy.data, h)
        d_gate_up, dw_P, dyb, wh = _backward_glu(dy, base, w_P, gate_up, lora, sched, ctx.glu, need["weights"],
                                                 wh_for_wd)
        # d_gate_up @ B_gu per sorted row: the rank-r signal reaching A_gu and, through it, x
        lg, lg_term = _low_rank(Rows(d_gate_up, False), B_gu if need["x"] or need["A_gu"] else None, A_gu,
                                ctx.scale, sched, transposed=True)
        grads = _input_grads(d_gate_up, dw_P, base, b_d, dy.data, idx_Tk, lg_term, sched, need)
        grads |= _weight_grads(x, dy, d_gate_up, w_P, idx_Tk, h, wh, xa, ha, dyb, lg, lora, sched, need)
        # each gradient in its input's dtype (the kernels accumulate some in fp32)
        return None, None, None, *(grads[n].to(ctx.dtypes[n]) if n in grads else None for n in _INPUTS)


def _backward_glu(dy: Rows, base: BaseWeights, w_P, gate_up, lora: Lora, sched: Schedule, glu: Glu, want_dw: bool,
                  want_wh: bool):
    """-> (d_gate_up_S2F, d(routing weight) in pair order [T * k] or None, dy @ B_d per row or None,
    w * h per row or None)."""
    S, dtype, device = sched.pair_S.numel(), dy.data.dtype, dy.data.device
    dyb, low_rank = _low_rank(dy, lora.B_d_EDr, lora.A_d_ErF, lora.scale, sched, transposed=True)
    # dh before the routing weight, which the GLU pass applies (it needs the unscaled rows for dw)
    dh_raw = buffers.empty(S, gate_up.shape[1] // 2, dtype=dtype, device=device)
    grouped_gemm(dy.data, base.down(transposed=True), sched, dh_raw, gather_a=dy.by_token, low_rank=low_rank)
    d_gate_up, dw_P, wh = routed_glu_backward(dh_raw, gate_up, w_P, sched, glu, want_dw, want_wh)
    return d_gate_up, dw_P, dyb, wh


def _input_grads(d_gate_up, dw_P, base: BaseWeights, b_d, dy_TD, idx_Tk, low_rank: LowRank | None,
                 sched: Schedule, need: dict) -> dict:
    grads = {}
    k = sched.top_k
    if dw_P is not None:
        dw_Tk = dw_P.view(-1, k)
        if b_d is not None:
            # the down bias is scaled by the routing weight too: d w[t, j] += dy[t] . b_d[idx[t, j]]
            dw_Tk = dw_Tk + (dy_TD.float() @ b_d.float().T).gather(1, idx_Tk)
        grads["weights"] = dw_Tk
    if need["x"]:
        w_gu = base.gate_up(transposed=True)
        dx_pairs = buffers.empty(d_gate_up.shape[0], w_gu.num_columns(), dtype=d_gate_up.dtype,
                                 device=d_gate_up.device)
        grouped_gemm(d_gate_up, w_gu, sched, dx_pairs, scatter_out=True, low_rank=low_rank)
        grads["x"] = sum_k(dx_pairs, k)
    return grads


def _weight_grads(x: Rows, dy: Rows, d_gate_up, w_P, idx_Tk, h, wh, xa, ha, dyb, lg, lora: Lora, sched: Schedule,
                  need: dict) -> dict:
    """h takes the routing weight w as a row scale in the down-side gradients (wh: w * h, or None)."""
    s = lora.scale
    grads = {}
    if need["w_gu"]:
        grads["w_gu"] = _gate_up_wgrad(x, d_gate_up, sched)
    if need["w_d"]:
        grad = gluon_wgrad.wgrad(dy.data, wh, sched, gather_a=True) if wh is not None else None
        if grad is not None:
            grads["w_d"] = grad
        elif grouped_mm_takes(dy.data, h):
            # a copy of dy's rows in expert order, scaled by the routing weight, and torch._grouped_mm beat
            # grouped_wgrad's gather and scale along its reduction
            grads["w_d"] = sorted_rows_wgrad(gather_tokens(dy.data, sched, row_scale_P=w_P), h, sched)
        else:
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


def _gate_up_wgrad(x: Rows, d_gate_up_S2F, sched: Schedule):
    """[E, 2F, D]: x's rows by token through the Gluon kernel's transposed form (d_gate_up^T x, x gathered as its a),
    else over a copy in expert order (made by the forward, or here where the kernel did not compile)."""
    if x.by_token:
        grad = (gluon_wgrad.wgrad(x.data, d_gate_up_S2F, sched, gather_a=True, transposed=True)
                if gluon_wgrad.fits(x.data, d_gate_up_S2F) else None)
        if grad is not None:
            return grad
        x = Rows(gather_tokens(x.data, sched), False)
    return _base_wgrad(d_gate_up_S2F, x.data, sched)


def _base_wgrad(a_SM, b_SN, sched: Schedule):
    """Per expert a^T b over its sorted rows: the Gluon kernel, torch._grouped_mm or grouped_wgrad, the first that
    takes the operands."""
    grad = gluon_wgrad.wgrad(a_SM, b_SN, sched) if gluon_wgrad.fits(a_SM, b_SN) else None
    if grad is None:
        grad = sorted_rows_wgrad(a_SM, b_SN, sched)
    return grad if grad is not None else grouped_wgrad(a_SM, b_SN, sched)


def _low_rank(a: Rows, left, right, scale: float, sched: Schedule, transposed: bool = False):
    """(a's rows times the rank-r LoRA factor `left` of their expert [S, r], the LoRA term scale * that @ right[e]^T
    of the GEMM over a), or (None, None) without that factor."""
    if left is None:
        return None, None
    mid = buffers.empty(sched.pair_S.numel(), left.shape[2 if transposed else 1], dtype=a.data.dtype,
                        device=a.data.device)
    grouped_gemm(a.data, Weight(left, transposed), sched, mid, gather_a=a.by_token)
    return mid, LowRank(mid, Weight(right, transposed), scale)


def _segment_sum(rows_SN: torch.Tensor, sched: Schedule) -> torch.Tensor:
    out = torch.zeros(sched.num_experts, rows_SN.shape[1], dtype=torch.float32, device=rows_SN.device)
    return out.index_add_(0, sched.expert_S.long(), rows_SN)


def _routed_sum(rows_TN: torch.Tensor, w_P: torch.Tensor, idx_Tk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E, N]: sum over pairs (t, j) routed to e of w[t, j] * rows[t], as (routing matrix)^T @ rows."""
    route_TE = torch.zeros(rows_TN.shape[0], num_experts, dtype=torch.float32, device=rows_TN.device)
    route_TE.scatter_add_(1, idx_Tk, w_P.view(idx_Tk.shape).float())
    return route_TE.T @ rows_TN


def _fused_activation(activation: str, glu_alpha: float | None, situ_betas) -> bool:
    """The GLUs the kernels' epilogues compute: silu, the gpt-oss form, and Kimi K3's SiTU-GLU."""
    return activation == "silu" or glu_alpha is not None or (activation == SITU and situ_betas is not None)


def _situ(activation: str, situ_betas) -> tuple[float, float | None] | None:
    if activation != SITU:
        return None
    beta, linear_beta = situ_betas
    return float(beta), float(linear_beta) if linear_beta is not None else None


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
    """Routed experts, y_TD = sum_j weights[t, j] * expert_{idx[t, j]}(x[t]), in x's dtype.
    Contract of reference_ops/moe.py; the kernels implement silu, the gpt-oss GLU and SiTU-GLU, other activations
    (a package's generated ones too) run through the torch form, as the dense MLP kernel does."""
    if not _fused_activation(activation, glu_alpha, situ_betas):
        return torch_ops.swiglu_experts(
            x_TD, weights_Tk, idx_Tk, w_gate_up_E2FD, w_down_EDF, b_gate_up_E2F=b_gate_up_E2F, b_down_ED=b_down_ED,
            activation=activation, clamp=clamp, situ_betas=situ_betas, interleaved_gate_up=interleaved_gate_up,
            lora_gate_up=lora_gate_up, lora_down=lora_down, lora_scale=lora_scale)
    A_gu, B_gu = lora_gate_up if lora_gate_up is not None else (None, None)
    A_d, B_d = lora_down if lora_down is not None else (None, None)
    glu = Glu(interleaved_gate_up, clamp, glu_alpha, _situ(activation, situ_betas))
    return _SwigluExperts.apply(float(lora_scale), glu, None, x_TD.contiguous(), weights_Tk, idx_Tk, w_gate_up_E2FD,
                                w_down_EDF, b_gate_up_E2F, b_down_ED, A_gu, B_gu, A_d, B_d, None, None)


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
    """Routed experts over frozen base weights in their released format, decoded tile by tile inside the grouped
    GEMMs (contract: runtime/ops/stored_matmul/README.md; truth: reference_ops/stored.py). Activations the kernels
    do not fuse run through the torch form, as in swiglu_experts."""
    gate_up_codes, gate_up_scale = stored_operands(gate_up_codes, gate_up_scale, kind)
    down_codes, down_scale = stored_operands(down_codes, down_scale, kind)
    if not _fused_activation(activation, glu_alpha, situ_betas):
        return torch_ops.stored_swiglu_experts(
            x_TD, weights_Tk, idx_Tk, gate_up_codes, gate_up_scale, down_codes, down_scale, kind=kind, block=block,
            b_gate_up_E2F=b_gate_up_E2F, b_down_ED=b_down_ED, activation=activation, clamp=clamp,
            situ_betas=situ_betas, interleaved_gate_up=interleaved_gate_up, lora_gate_up=lora_gate_up,
            lora_down=lora_down, lora_scale=lora_scale)
    A_gu, B_gu = lora_gate_up if lora_gate_up is not None else (None, None)
    A_d, B_d = lora_down if lora_down is not None else (None, None)
    glu = Glu(interleaved_gate_up, clamp, glu_alpha, _situ(activation, situ_betas))
    stored = (kind, tuple(block) if block is not None else None)
    return _SwigluExperts.apply(float(lora_scale), glu, stored, x_TD.contiguous(), weights_Tk, idx_Tk, gate_up_codes,
                                down_codes, b_gate_up_E2F, b_down_ED, A_gu, B_gu, A_d, B_d, gate_up_scale, down_scale)

