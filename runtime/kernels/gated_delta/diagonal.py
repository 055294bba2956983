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

Token-parallel alternative (KernelVariant.token_parallel_diag, per-channel decay, no inverse):
`diag_token_kernel` and `diag_grad_token_kernel` run one program per (token, BH heads) on [BH, K] tiles
(contiguous in the packed layout, one warp per head), walking the <= S other rows of the token's sub-chunk
straight from memory with the decay between the two tokens summed on the way (no cumsum); the backward
takes token t's share as a row of the blocks (dq, and dk / dbeta through beta k) and as a column (dk
through k_j) in two walks, finishes dq, dk (l2norm) and dbeta itself and leaves dgc for
`dg_finish_kernel`'s reverse cumsum (per chunk, head and 32 channels). The column-walking kernels above
are shuffle- and latency-bound (H200, B1 T8192 H32 K128: diag_kernel 2.50 ms, diag_grad_kernel 3.16 ms).
Prediction at that shape (BH 4, 4 warps, 65536 programs, ptxas 48 / 93 registers, no spills, 16 programs
per SM): forward 0.15-0.25 ms (8.5 rows walked per token, ~2 KB per row from L2: ~1.1 GB of L2 traffic,
5.4e8 exps / 2 = 0.05 ms of SFU), backward 0.3-0.45 ms (17 rows walked, ~3 KB each: ~2.8 GB from L2)
plus dg_finish 0.02-0.03 ms (32 MB fp32 read, 16 MB written).

Shape legend: T packed tokens, H heads, K key dim, C chunk size, S sub-chunk size, X 1 (GDN) or K (KDA).
"""
from __future__ import annotations

import triton
import triton.language as tl

from runtime.kernels.gated_delta.backward import l2norm_bwd, stored_inv_norms
from runtime.kernels.gated_delta.common import l2norm_rows, row_of
from runtime.kernels.gated_delta.forward import chunk_inputs, chunk_tokens, load_gc, load_rows, store_rows


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
def unit_rows(ptr, norms_ptr, slot: tl.constexpr, scale, rows_R, valid_R, K: tl.constexpr, L2NORM: tl.constexpr,
              STORED: tl.constexpr):
    """(x_RK l2-normalized over K (with L2NORM) and times scale, the inverse norms without the scale) of the rows
    rows_R (token * H + head) of a packed [T, H, K] tensor: with STORED from the norms prep stored
    (KernelVariant.stored_norms; slot 0 k's, slot 1 q's, which hold the scale), else recomputed."""
    x = tl.load(ptr + rows_R.to(tl.int64)[:, None] * K + tl.arange(0, K)[None, :], mask=valid_R[:, None],
                other=0.0).to(tl.float32)
    if STORED:
        f_R = stored_inv_norms(norms_ptr, rows_R, slot, valid_R)
        y, inv_R = x * f_R[:, None], f_R / scale
    else:
        y, inv_R = l2norm_rows(x, 1e-6, L2NORM)
        y = y * scale
    return y, inv_R


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
def diag_grad_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, norms_ptr, chunk_start_ptr, chunk_end_ptr, dldiag_ptr,
                     dpdiag_ptr, part_dq_ptr, part_dk_ptr, part_dgc_ptr, part_db_ptr, dgl_ptr, dq_ptr, dk_ptr, dg_ptr,
                     dbeta_ptr, scale, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                     L2NORM: tl.constexpr, STORED_NORMS: tl.constexpr):
    """Per (chunk, head): final dq, dk, dg, dbeta from the partials and the diagonal blocks of dL and dP
    (STORED_NORMS: with the inverse norms prep stored, see unit_rows)."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    chunk_start, chunk_end = tl.load(chunk_start_ptr + chunk), tl.load(chunk_end_ptr + chunk)
    # dg_t = sum of dgc over s >= t in the chunk, plus dgc_last: carried from the later sub-chunks
    carry_K = tl.load(dgl_ptr + (chunk.to(tl.int64) * H + head) * K + tl.arange(0, K))
    for i in range(C // S):
        tok = chunk_start + (C // S - 1 - i) * S + tl.arange(0, S)
        valid = tok < chunk_end
        q, q_inv = unit_rows(q_ptr, norms_ptr, 1, scale, tok * H + head, valid, K, L2NORM, STORED_NORMS)
        k, k_inv = unit_rows(k_ptr, norms_ptr, 0, 1.0, tok * H + head, valid, K, L2NORM, STORED_NORMS)
        gc = load_gc(g_ptr, tok, valid, H, K, head, True)
        beta = tl.load(beta_ptr + tok.to(tl.int64) * H + head, mask=valid, other=0.0).to(tl.float32)
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


# Token-parallel kernels (KernelVariant.token_parallel_diag): one program per (token, block of BH heads)
# on [BH, K] tiles, which are contiguous in the packed [T, H, K] layout. Each program walks the other
# rows of its sub-chunk, loading each row from memory (L1/L2: the sub-chunk's 16 programs share them)
# and accumulating the decay between the two tokens as a running sum of g, so no cumsum, no row
# extraction from a register tile and no column scatter: one exp per [BH, K] element and a reduction
# over K (lanes of one warp) per row pair.


@triton.jit
def token_position(chunk_start_ptr, chunk_end_ptr, C: tl.constexpr, S: tl.constexpr):
    """(token, first token of its sub-chunk, end of its sub-chunk, end of its chunk) of this program (axis 0:
    NC * C programs, the C positions of every chunk; those past the chunk's end have nothing to do)."""
    chunk = tl.program_id(0) // C
    pos = tl.program_id(0) % C
    chunk_start = tl.load(chunk_start_ptr + chunk)
    chunk_end = tl.load(chunk_end_ptr + chunk)
    sub_start = chunk_start + (pos // S) * S
    return chunk_start + pos, sub_start, tl.minimum(sub_start + S, chunk_end), chunk_end


@triton.jit
def head_rows(ptr, tok, heads_B, H: tl.constexpr, D: tl.constexpr):
    """x_BD in fp32: token tok's rows for the heads heads_B of a packed [T, H, D] tensor."""
    offs = (tok.to(tl.int64) * H + heads_B)[:, None] * D + tl.arange(0, D)[None, :]
    return tl.load(ptr + offs).to(tl.float32)


@triton.jit
def store_head_rows(ptr, x_BD, tok, heads_B, H: tl.constexpr, D: tl.constexpr):
    offs = (tok.to(tl.int64) * H + heads_B)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(ptr + offs, x_BD.to(ptr.dtype.element_ty))


@triton.jit
def diag_token_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, chunk_start_ptr, chunk_end_ptr, ldiag_ptr, pdiag_ptr,
                      scale, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                      BH: tl.constexpr, L2NORM: tl.constexpr):
    """Per (token i, BH heads), per-channel decay: row i of the diagonal blocks of L (beta_i sum_d k_id k_jd
    exp(gc_id - gc_jd), j < i) and P (q_i in place of beta_i k_i, j <= i) as [T, H, S] rows, zero past i."""
    tok, sub_start, sub_end, chunk_end = token_position(chunk_start_ptr, chunk_end_ptr, C, S)
    if tok < chunk_end:
        heads = tl.program_id(1) * BH + tl.arange(0, BH)
        q_i = l2norm_rows(head_rows(q_ptr, tok, heads, H, K), 1e-6, L2NORM)[0]
        k_i = l2norm_rows(head_rows(k_ptr, tok, heads, H, K), 1e-6, L2NORM)[0]
        bk_i = tl.load(beta_ptr + tok.to(tl.int64) * H + heads).to(tl.float32)[:, None] * k_i
        q_i = q_i * scale
        cols = tl.arange(0, S)
        l_BS = tl.zeros([BH, S], tl.float32)
        p_BS = tl.zeros([BH, S], tl.float32)
        # gc_i - gc_j = g_{j+1} + ... + g_i (<= 0): summed while walking j from i down to the sub-chunk start
        decay = tl.zeros([BH, K], tl.float32)
        for back in range(tok - sub_start + 1):
            j = tok - back
            k_j = l2norm_rows(head_rows(k_ptr, j, heads, H, K), 1e-6, L2NORM)[0]
            kj_e = k_j * tl.exp(decay)
            at_j = cols[None, :] == j - sub_start
            l_BS = tl.where(at_j & (back > 0), tl.sum(bk_i * kj_e, 1)[:, None], l_BS)
            p_BS = tl.where(at_j, tl.sum(q_i * kj_e, 1)[:, None], p_BS)
            decay += head_rows(g_ptr, j, heads, H, K)
        store_head_rows(ldiag_ptr, l_BS, tok, heads, H, S)
        store_head_rows(pdiag_ptr, p_BS, tok, heads, H, S)


@triton.jit
def diag_grad_token_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, norms_ptr, chunk_start_ptr, chunk_end_ptr, dldiag_ptr,
                           dpdiag_ptr, part_dq_ptr, part_dk_ptr, part_dgc_ptr, part_db_ptr, dq_ptr, dk_ptr, dbeta_ptr,
                           scale, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                           BH: tl.constexpr, L2NORM: tl.constexpr, STORED_NORMS: tl.constexpr):
    """Per (token t, BH heads), per-channel decay: the diagonal blocks' share of the gradients of token t,
    as the row (dL_ts, dP_ts against s <= t: da_l, da_p) and as the column (dL_st, dP_st, s >= t: dc) of
    the blocks; writes the final dq, dk (through l2norm) and dbeta, and dgc over part_dgc in place (each
    program its own row) for dg_finish_kernel's reverse cumsum. STORED_NORMS: every row's inverse norms from prep's
    [T, H, 2] (see unit_rows) instead of a reduction over K per row walked."""
    tok, sub_start, sub_end, chunk_end = token_position(chunk_start_ptr, chunk_end_ptr, C, S)
    if tok < chunk_end:
        heads = tl.program_id(1) * BH + tl.arange(0, BH)
        every = tl.full([BH], 1, tl.int1)
        pos = tok - sub_start
        q_t, q_inv = unit_rows(q_ptr, norms_ptr, 1, scale, tok * H + heads, every, K, L2NORM, STORED_NORMS)
        k_t, k_inv = unit_rows(k_ptr, norms_ptr, 0, 1.0, tok * H + heads, every, K, L2NORM, STORED_NORMS)
        beta_t = tl.load(beta_ptr + tok.to(tl.int64) * H + heads).to(tl.float32)
        dl_row = head_rows(dldiag_ptr, tok, heads, H, S)
        dp_row = head_rows(dpdiag_ptr, tok, heads, H, S)
        cols = tl.arange(0, S)
        # as the row: da_l = sum_{s<t} dL_ts k_s e_ts, da_p = sum_{s<=t} dP_ts k_s e_ts
        da_l = tl.zeros([BH, K], tl.float32)
        da_p = tl.zeros([BH, K], tl.float32)
        decay = tl.zeros([BH, K], tl.float32)
        for back in range(pos + 1):
            s = tok - back
            k_s = unit_rows(k_ptr, norms_ptr, 0, 1.0, s * H + heads, every, K, L2NORM, STORED_NORMS)[0]
            ks_e = k_s * tl.exp(decay)
            at_s = cols[None, :] == pos - back
            da_l += tl.sum(tl.where(at_s & (back > 0), dl_row, 0.0), 1)[:, None] * ks_e
            da_p += tl.sum(tl.where(at_s, dp_row, 0.0), 1)[:, None] * ks_e
            decay += head_rows(g_ptr, s, heads, H, K)
        # as the column: dc = sum_{s>=t} (dL_st beta_s k_s + dP_st q_s) e_st, gc_s - gc_t = g_{t+1} + ... + g_s
        dc = tl.zeros([BH, K], tl.float32)
        decay = tl.zeros([BH, K], tl.float32)
        for ahead in range(sub_end - tok):
            s = tok + ahead
            if ahead > 0:
                decay += head_rows(g_ptr, s, heads, H, K)
            q_s = unit_rows(q_ptr, norms_ptr, 1, scale, s * H + heads, every, K, L2NORM, STORED_NORMS)[0]
            k_s = unit_rows(k_ptr, norms_ptr, 0, 1.0, s * H + heads, every, K, L2NORM, STORED_NORMS)[0]
            beta_s = tl.load(beta_ptr + s.to(tl.int64) * H + heads).to(tl.float32)
            row_s = (s.to(tl.int64) * H + heads) * S + pos
            dl_st = tl.where(ahead > 0, tl.load(dldiag_ptr + row_s), 0.0)
            dp_st = tl.load(dpdiag_ptr + row_s)
            dc += ((dl_st * beta_s)[:, None] * k_s + dp_st[:, None] * q_s) * tl.exp(decay)
        dq = head_rows(part_dq_ptr, tok, heads, H, K) + da_p
        dk = head_rows(part_dk_ptr, tok, heads, H, K) + beta_t[:, None] * da_l + dc
        dgc = head_rows(part_dgc_ptr, tok, heads, H, K) + beta_t[:, None] * k_t * da_l + q_t * da_p - k_t * dc
        db = tl.load(part_db_ptr + tok.to(tl.int64) * H + heads) + tl.sum(da_l * k_t, 1)
        store_head_rows(part_dgc_ptr, dgc, tok, heads, H, K)
        tl.store(dbeta_ptr + tok.to(tl.int64) * H + heads, db.to(dbeta_ptr.dtype.element_ty))
        store_head_rows(dq_ptr, l2norm_bwd(q_t / scale, q_inv, dq * scale, L2NORM), tok, heads, H, K)
        store_head_rows(dk_ptr, l2norm_bwd(k_t, k_inv, dk, L2NORM), tok, heads, H, K)


@triton.jit
def dg_finish_kernel(dgc_ptr, dgl_ptr, chunk_start_ptr, chunk_end_ptr, dg_ptr, H: tl.constexpr, K: tl.constexpr,
                     C: tl.constexpr, BK: tl.constexpr):
    """Per (chunk, head, BK channels), per-channel decay: dg_t = dgc_last + sum of dgc over s >= t in the chunk
    (column blocks: a [C, K] cumsum over rows takes ptxas past 200 registers at 8 warps)."""
    chunk, head, col0 = tl.program_id(0), tl.program_id(1), tl.program_id(2) * BK
    tok, valid = chunk_tokens(chunk_start_ptr, chunk_end_ptr, chunk, C)
    offs = (tok.to(tl.int64) * H + head)[:, None] * K + col0 + tl.arange(0, BK)[None, :]
    dgc = tl.load(dgc_ptr + offs, mask=valid[:, None], other=0.0)
    dgl = tl.load(dgl_ptr + (chunk.to(tl.int64) * H + head) * K + col0 + tl.arange(0, BK))
    dg = dgl[None, :] + tl.sum(dgc, 0)[None, :] - tl.cumsum(dgc, 0) + dgc
    tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=valid[:, None])
