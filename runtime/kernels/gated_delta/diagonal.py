"""Triton kernels for the S x S diagonal blocks of the chunk matrices (the split-diagonal variant).

One program per (sub-chunk, head) on [S, K] tiles, instead of every chunk program walking [C/S, S, K]
tiles column by column: S / C of the registers per program and C / S times the programs. Stores, as
rows of [T, H, S] (row t holds its entries against the S tokens of its own sub-chunk):
  L diagonal blocks (beta gram(k, k), strict)  -- per channel only,
  (I + L)^-1 diagonal blocks                   -- with INVERSE (prep_kernel's split-diagonal path),
  P diagonal blocks (gram(q, k), j <= i)       -- per channel only.
Only differences of the cumulative decay inside one sub-chunk enter, so a sub-chunk-local cumsum
gives the same blocks (and the same gradients) as the chunk's.
`diag_grad_kernel` (per chunk and head, per-channel decay only) adds the diagonal blocks' share of the
gradients to the partials backward.py's state_grad_kernel and wy_grad_kernel stored, walking the
sub-chunks last to first on [S, K] tiles, and finishes dg (reverse cumsum), dbeta, and dq, dk (through l2norm).

Shape legend: T packed tokens, H heads, K key dim, C chunk size, S sub-chunk size, X 1 (GDN) or K (KDA).
"""
from __future__ import annotations

import triton
import triton.language as tl

from runtime.kernels.gated_delta.backward import l2norm_bwd
from runtime.kernels.gated_delta.common import row_of
from runtime.kernels.gated_delta.forward import chunk_inputs, load_rows, store_rows


@triton.jit
def sub_chunk_tokens(chunk_start_ptr, chunk_end_ptr, sub, C: tl.constexpr, S: tl.constexpr):
    """Token ids and validity of sub-chunk `sub` (counted over all chunks, C / S per chunk)."""
    chunk = sub // (C // S)
    start = tl.load(chunk_start_ptr + chunk) + (sub % (C // S)) * S
    tok = start + tl.arange(0, S)
    return tok, tok < tl.load(chunk_end_ptr + chunk)


@triton.jit
def exact_diag_grams(q_SK, k_SK, gc_SK, S: tl.constexpr):
    """(gram(k, k) strict, gram(q, k) with j <= i) of one sub-chunk, per-channel decay summed exactly."""
    ii = tl.arange(0, S)
    m_kk = tl.zeros([S, S], tl.float32)
    m_qk = tl.zeros([S, S], tl.float32)
    for jj in range(S):
        k_j = row_of(k_SK, jj, S)
        g_j = row_of(gc_SK, jj, S)
        # exponents stay <= 0: rows above jj are masked before the exp
        e_SK = tl.exp(tl.where(ii[:, None] >= jj, gc_SK - g_j[None, :], float("-inf")))
        kj_e = k_j[None, :] * e_SK
        col_kk = tl.where(ii > jj, tl.sum(k_SK * kj_e, 1), 0.0)
        col_qk = tl.sum(q_SK * kj_e, 1)
        m_kk += tl.where(ii[None, :] == jj, col_kk[:, None], 0.0)
        m_qk += tl.where(ii[None, :] == jj, col_qk[:, None], 0.0)
    return m_kk, m_qk


@triton.jit
def unit_lower_inverse_small(l_SS, S: tl.constexpr):
    """(I + L)^-1 of one strictly lower S x S block by row substitution: row r = e_r - sum_j L_rj row j."""
    ii = tl.arange(0, S)
    t_SS = (ii[:, None] == ii[None, :]).to(tl.float32)
    for r in range(1, S):
        l_row = row_of(l_SS, r, S)
        new_row = tl.where(ii == r, 1.0, 0.0) - tl.sum(l_row[:, None] * t_SS, 0)
        t_SS = tl.where(ii[:, None] == r, new_row[None, :], t_SS)
    return t_SS


@triton.jit
def diag_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, chunk_start_ptr, chunk_end_ptr, ldiag_ptr, tdiag_ptr, pdiag_ptr,
                scale, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                PER_CHANNEL: tl.constexpr, L2NORM: tl.constexpr, INVERSE: tl.constexpr, PREC: tl.constexpr):
    """Per (sub-chunk, head): the diagonal blocks of L, P (per channel) and, with INVERSE, (I + L)^-1
    (see the module docstring; without INVERSE prep inverts them by doubling)."""
    sub, head = tl.program_id(0), tl.program_id(1)
    tok, valid = sub_chunk_tokens(chunk_start_ptr, chunk_end_ptr, sub, C, S)
    q, k, gc, beta, _, _ = chunk_inputs(q_ptr, k_ptr, g_ptr, beta_ptr, tok, valid, head, scale,
                                        H, K, PER_CHANNEL, L2NORM)
    ii = tl.arange(0, S)
    if PER_CHANNEL:
        m_kk, m_qk = exact_diag_grams(q, k, gc, S)
        l_SS = beta[:, None] * m_kk
        store_rows(ldiag_ptr, l_SS, tok, valid, H, S, head)
        store_rows(pdiag_ptr, m_qk, tok, valid, H, S, head)
    else:
        g_S = tl.sum(gc, 1)
        decay = tl.exp(tl.where(ii[:, None] > ii[None, :], g_S[:, None] - g_S[None, :], float("-inf")))
        l_SS = beta[:, None] * tl.dot(k, tl.trans(k), input_precision=PREC) * decay
    if INVERSE:
        store_rows(tdiag_ptr, unit_lower_inverse_small(l_SS, S), tok, valid, H, S, head)


@triton.jit
def diag_grad_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, chunk_start_ptr, chunk_end_ptr, dldiag_ptr, dpdiag_ptr,
                     part_dq_ptr, part_dk_ptr, part_dgc_ptr, part_db_ptr, dgl_ptr, dq_ptr, dk_ptr, dg_ptr, dbeta_ptr,
                     scale, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                     L2NORM: tl.constexpr):
    """Per (chunk, head): final dq, dk, dg, dbeta from the partials and the diagonal blocks of dL and dP."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    chunk_start, chunk_end = tl.load(chunk_start_ptr + chunk), tl.load(chunk_end_ptr + chunk)
    # dg_t = sum of dgc over s >= t in the chunk, plus dgc_last: carried from the later sub-chunks
    carry_K = tl.load(dgl_ptr + (chunk.to(tl.int64) * H + head) * K + tl.arange(0, K))
    for i in range(C // S):
        tok = chunk_start + (C // S - 1 - i) * S + tl.arange(0, S)
        valid = tok < chunk_end
        q, k, gc, beta, q_inv, k_inv = chunk_inputs(q_ptr, k_ptr, g_ptr, beta_ptr, tok, valid, head, scale,
                                                    H, K, True, L2NORM)
        da_l, da_p, dc = exact_diag_grams_bwd(load_rows(dldiag_ptr, tok, valid, H, S, head),
                                              load_rows(dpdiag_ptr, tok, valid, H, S, head), beta, q, k, gc, S)
        dq = load_rows(part_dq_ptr, tok, valid, H, K, head) + da_p
        dk = load_rows(part_dk_ptr, tok, valid, H, K, head) + beta[:, None] * da_l + dc
        dgc = load_rows(part_dgc_ptr, tok, valid, H, K, head) + beta[:, None] * k * da_l + q * da_p - k * dc
        db = tl.load(part_db_ptr + tok.to(tl.int64) * H + head, mask=valid, other=0.0) + tl.sum(da_l * k, 1)
        store_rows(dg_ptr, carry_K[None, :] + tl.sum(dgc, 0)[None, :] - tl.cumsum(dgc, 0) + dgc, tok, valid, H, K, head)
        carry_K += tl.sum(dgc, 0)
        tl.store(dbeta_ptr + tok.to(tl.int64) * H + head, db.to(dbeta_ptr.dtype.element_ty), mask=valid)
        store_rows(dq_ptr, l2norm_bwd(q / scale, q_inv, dq * scale, L2NORM), tok, valid, H, K, head)
        store_rows(dk_ptr, l2norm_bwd(k, k_inv, dk, L2NORM), tok, valid, H, K, head)


@triton.jit
def exact_diag_grams_bwd(dl_SS, dp_SS, beta_S, q_SK, k_SK, gc_SK, S: tl.constexpr):
    """Gradients through the exact diagonal blocks M_ij = sum_d a_id k_jd exp(gc_id - gc_jd) (j <= i) of
    L (a = beta k) and P (a = q), given dL and dP masked to their patterns, in one pass sharing each
    column's decay factors: (da of L, da of P, the sum of both dk_j shares)."""
    ii = tl.arange(0, S)
    da_l = tl.zeros_like(k_SK)
    da_p = tl.zeros_like(k_SK)
    dc = tl.zeros_like(k_SK)
    bk_SK = beta_S[:, None] * k_SK
    for jj in range(S):
        k_j = row_of(k_SK, jj, S)
        g_j = row_of(gc_SK, jj, S)
        e_SK = tl.exp(tl.where(ii[:, None] >= jj, gc_SK - g_j[None, :], float("-inf")))
        coef_l = tl.sum(tl.where(ii[None, :] == jj, dl_SS, 0.0), 1)[:, None] * e_SK
        coef_p = tl.sum(tl.where(ii[None, :] == jj, dp_SS, 0.0), 1)[:, None] * e_SK
        da_l += coef_l * k_j[None, :]
        da_p += coef_p * k_j[None, :]
        dc += tl.where(ii[:, None] == jj, tl.sum(coef_l * bk_SK + coef_p * q_SK, 0)[None, :], 0.0)
    return da_l, da_p, dc
