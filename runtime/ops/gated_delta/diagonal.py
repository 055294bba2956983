"""KDA's exact per-channel diagonal blocks: the S x S blocks of L and P on the chunk's diagonal, and their
share of the gradients.

Inside a sub-chunk the decay between two tokens is summed exactly, channel by channel (products across
sub-chunks are split at the rows bounding their sub-chunks instead, common.decayed_grams). One program per
(token, BH heads) on [BH, K] tiles, contiguous in the packed layout, walks the <= S other rows of its
sub-chunk straight from memory, summing the decay between the two tokens on the way (no cumsum, no row
extraction from register tiles). `diag_token_kernel` stores the blocks as rows [T, H, S] (row t holds its
entries against the S tokens of its own sub-chunk); `diag_grad_token_kernel` takes token t's share as a
row of the blocks and as a column, finishes dq, dk (l2norm) and dbeta, and leaves dgc for
`dg_finish_kernel`'s reverse cumsum.

Shape legend: T packed tokens, H heads, K key dim, C chunk size, S sub-chunk size, BH heads per program.
"""
from __future__ import annotations

import triton
import triton.language as tl

from runtime.ops.gated_delta.common import LOG2E, l2norm_bwd, row_scales
from runtime.ops.gated_delta.forward import chunk_tokens, load_cols, store_cols


@triton.jit
def unit_rows(ptr, norms_ptr, slot: tl.constexpr, scale, tok, heads_B, H: tl.constexpr, K: tl.constexpr,
              L2NORM: tl.constexpr):
    """(x_BK l2-normalized over K (with L2NORM) and times scale, the inverse norms without the scale): token tok's
    rows for the heads heads_B of a packed [T, H, K] tensor, by the norms prep stored (common.row_scales)."""
    f_B = row_scales(norms_ptr, slot, scale, tok * H + heads_B, heads_B < H, L2NORM)
    return head_rows(ptr, tok, heads_B, H, K) * f_B[:, None], f_B / scale


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
def diag_token_kernel(q_ptr, k_ptr, g_ptr, chunk_start_ptr, chunk_end_ptr, ldiag_ptr, pdiag_ptr, H: tl.constexpr,
                      K: tl.constexpr, C: tl.constexpr, S: tl.constexpr, BH: tl.constexpr):
    """Per (token i, BH heads), per-channel decay, on the raw inputs: row i of the diagonal blocks of the decayed
    Gram products k k^T (sum_d k_id k_jd exp(gc_id - gc_jd), j < i) and q k^T (q_i in place of k_i, j <= i) as
    [T, H, S] rows, zero past i. The kernel is issue-bound, so each pair costs as few instructions as it can:
    prep_blocked_kernel applies the l2norm, beta and the scale (as to its own Gram products; here they took a norm
    of k_j, a reduction over K, for every pair), the decay is summed in log2 units (exp2 flushes to zero below
    2^-126 where exp takes a denormal path), and each pair's entries are stored as they come."""
    tok, sub_start, sub_end, chunk_end = token_position(chunk_start_ptr, chunk_end_ptr, C, S)
    if tok < chunk_end:
        heads = tl.program_id(1) * BH + tl.arange(0, BH)
        q_i = head_rows(q_ptr, tok, heads, H, K)
        k_i = head_rows(k_ptr, tok, heads, H, K)
        row_offs = (tok.to(tl.int64) * H + heads) * S - sub_start
        later = sub_start + tl.arange(0, S)[None, :] > tok
        tl.store(ldiag_ptr + row_offs[:, None] + sub_start + tl.arange(0, S)[None, :], 0.0, mask=later)
        tl.store(pdiag_ptr + row_offs[:, None] + sub_start + tl.arange(0, S)[None, :], 0.0, mask=later)
        # (gc_i - gc_j) LOG2E = (g_{j+1} + ... + g_i) LOG2E (<= 0): summed while walking j from i down to the
        # sub-chunk start
        decay = tl.zeros([BH, K], tl.float32)
        for back in range(tok - sub_start + 1):
            j = tok - back
            kj_e = head_rows(k_ptr, j, heads, H, K) * tl.exp2(decay)
            tl.store(ldiag_ptr + row_offs + j, tl.where(back > 0, tl.sum(k_i * kj_e, 1), 0.0))
            tl.store(pdiag_ptr + row_offs + j, tl.sum(q_i * kj_e, 1))
            decay += head_rows(g_ptr, j, heads, H, K) * LOG2E


@triton.jit
def diag_grad_token_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, norms_ptr, chunk_start_ptr, chunk_end_ptr, dldiag_ptr,
                           dpdiag_ptr, part_dq_ptr, part_dk_ptr, part_dgc_ptr, part_db_ptr, dq_ptr, dk_ptr, dbeta_ptr,
                           scale, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                           BH: tl.constexpr, L2NORM: tl.constexpr):
    """Per (token t, BH heads), per-channel decay: the diagonal blocks' share of the gradients of token t,
    as the row (dL_ts, dP_ts against s <= t: da_l, da_p) and as the column (dL_st, dP_st, s >= t: dc) of
    the blocks; writes the final dq, dk (through l2norm) and dbeta, and dgc over part_dgc in place (each
    program its own row) for dg_finish_kernel's reverse cumsum."""
    tok, sub_start, sub_end, chunk_end = token_position(chunk_start_ptr, chunk_end_ptr, C, S)
    if tok < chunk_end:
        heads = tl.program_id(1) * BH + tl.arange(0, BH)
        pos = tok - sub_start
        q_t, q_inv = unit_rows(q_ptr, norms_ptr, 1, scale, tok, heads, H, K, L2NORM)
        k_t, k_inv = unit_rows(k_ptr, norms_ptr, 0, 1.0, tok, heads, H, K, L2NORM)
        beta_t = tl.load(beta_ptr + tok.to(tl.int64) * H + heads).to(tl.float32)
        dl_row = head_rows(dldiag_ptr, tok, heads, H, S)
        dp_row = head_rows(dpdiag_ptr, tok, heads, H, S)
        cols = tl.arange(0, S)
        # token s's rows sit (s - t) H rows from t's: offsets from t's, so that a step costs one add per address
        rows_B = tok.to(tl.int64) * H + heads
        offs_BK = rows_B[:, None] * K + tl.arange(0, K)[None, :]
        # as the row: da_l = sum_{s<t} dL_ts k_s e_ts, da_p = sum_{s<=t} dP_ts k_s e_ts. The kernel is issue-bound:
        # k_s's inverse norm goes onto the [BH] coefficients instead of its [BH, K] row, and the decay is summed in
        # log2 units for exp2 (as diag_token_kernel does)
        da_l = tl.zeros([BH, K], tl.float32)
        da_p = tl.zeros([BH, K], tl.float32)
        decay = tl.zeros([BH, K], tl.float32)
        for back in range(pos + 1):
            k_inv_s = row_scales(norms_ptr, 0, 1.0, rows_B - back * H, heads < H, L2NORM)
            ks_e = tl.load(k_ptr + offs_BK - back * H * K).to(tl.float32) * tl.exp2(decay)
            at_s = cols[None, :] == pos - back
            da_l += (tl.sum(tl.where(at_s & (back > 0), dl_row, 0.0), 1) * k_inv_s)[:, None] * ks_e
            da_p += (tl.sum(tl.where(at_s, dp_row, 0.0), 1) * k_inv_s)[:, None] * ks_e
            decay += tl.load(g_ptr + offs_BK - back * H * K).to(tl.float32) * LOG2E
        # as the column: dc = sum_{s>=t} (dL_st beta_s k_s + dP_st q_s) e_st, gc_s - gc_t = g_{t+1} + ... + g_s;
        # the row scales of q_s and k_s on the coefficients as above
        dc = tl.zeros([BH, K], tl.float32)
        decay = tl.zeros([BH, K], tl.float32)
        for ahead in range(sub_end - tok):
            rows_s = rows_B + ahead * H
            offs_s = offs_BK + ahead * H * K
            if ahead > 0:
                decay += tl.load(g_ptr + offs_s).to(tl.float32) * LOG2E
            q_inv_s = row_scales(norms_ptr, 1, scale, rows_s, heads < H, L2NORM)
            k_inv_s = row_scales(norms_ptr, 0, 1.0, rows_s, heads < H, L2NORM)
            beta_s = tl.load(beta_ptr + rows_s).to(tl.float32)
            dl_st = tl.where(ahead > 0, tl.load(dldiag_ptr + rows_s * S + pos), 0.0)
            dp_st = tl.load(dpdiag_ptr + rows_s * S + pos)
            dc += ((dl_st * beta_s * k_inv_s)[:, None] * tl.load(k_ptr + offs_s).to(tl.float32)
                   + (dp_st * q_inv_s)[:, None] * tl.load(q_ptr + offs_s).to(tl.float32)) * tl.exp2(decay)
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
    (column blocks: a cumsum over whole [C, K] rows holds too many registers)."""
    chunk, head, col0 = tl.program_id(0), tl.program_id(1), tl.program_id(2) * BK
    start, _, valid = chunk_tokens(chunk_start_ptr, chunk_end_ptr, chunk, C)
    dgc = load_cols(dgc_ptr, start, valid, head, col0, H, K, C, BK)
    dgl = tl.load(dgl_ptr + (chunk.to(tl.int64) * H + head) * K + col0 + tl.arange(0, BK))
    dg = dgl[None, :] + tl.sum(dgc, 0)[None, :] - tl.cumsum(dgc, 0) + dgc
    store_cols(dg_ptr, dg, start, valid, head, col0, H, K, C, BK)
