"""Forward Triton kernels of the chunked gated delta rule (GDN scalar decay / KDA per-channel decay).

GDN's three launches: `prep_blocked_kernel` (every chunk in parallel, on [C, 64] column blocks: l2norm,
decay cumsum, the UT inverse Tinv, w, u, P, qg, kbar), `scan_kernel` (one program per sequence, head
and V block walks the chunks: states and v_new),
`output_kernel` (every chunk in parallel: o = qg h + P v_new; with KernelVariant.scan_output the scan
writes o and output_kernel is not launched). `prep_kernel` is the earlier prep on
whole [C, K] fp32 tiles (KernelVariant.blocked_prep=False). KDA's default runs five: diagonal.py's
`diag_token_kernel` first (the exact per-channel diagonal blocks of L and P), and prep in two launches
(KernelVariant.split_prep: `prep_blocked_kernel` to P, Tinv and the inverse norms, then
`prep_columns_kernel`). See runtime/ops/gated_delta.py for the
algebra. Tokens are packed [T, H, *] (batch folded into T, sequences given by cu_seqlens).

H200 at B1 T8192 H32 K=V=128 bf16, predicted -> measured (GPU ms, 2026-11-29; the forward before this
structure took 1.68 ms for GDN):
  prep_blocked (GDN): 0.25-0.30 -> 0.63 at 8 warps, 0.42 at 4 (now the default: two programs per SM
    despite 1748 B spilled). Predicted from bytes (0.64 GB = 0.15 ms); its time follows each program's
    chain of dependent steps at one or two programs per SM, not bytes (as backward.py's kernels).
    Column loops not unrolled (668 B spilled) measured no faster and were removed.
  prep (KDA): 0.45-0.6 -> prep_blocked 1.45 + diag_kernel 2.50; the per-channel default now takes
    prep_kernel (1.16) with diagonal.py's token-parallel diag_token_kernel (0.38).
  scan: 0.20-0.25 -> 0.27 (bf16 operands, 32-bit tile offsets, 4 warps, 244 registers). Holding the
    state as two K halves measured no faster (3.84 vs 3.82 ms fwd+bwd) and was removed.
  output: 0.11-0.13 -> 0.10.
  GDN forward 0.6-0.7 -> 1.35-1.52 ms wall (fla 0.6.0: 0.87-0.90), KDA 0.9-1.1 -> 2.48 ms.

Measured 2026-11-29 (bench/results/2026-11-29-gdn-kda-variants-1408.json and -1420.json):
  KernelVariant.split_prep: prep_blocked_kernel without COLUMNS stops at P and Tinv (and stores the rows'
    inverse norms), prep_columns_kernel makes kbar, w, qg and u from the stored Tinv. Predicted columns
    0.1-0.2 ms; measured 0.60 at 32 columns while it recomputed the l2 norms from q and k in every
    key-column program. Reading the first launch's norms instead, at 64 columns and 8 warps (126 / 162
    registers, no spills): KDA prep 1.16 -> 0.48 + columns, fwd+bwd 5.56 -> 5.25 ms (now the per-channel
    default); GDN 2.79 -> 2.89 (its one-launch prep stays the default).
  Nested per-channel Gram products in prep (the exact diagonal blocks on tensor cores over nested halves
    of the chunk, no diag kernel in the forward), predicted 0.8-1.2 ms for prep: measured 3.22 in one
    launch, 2.43 + columns 0.60 split (-kda-nested-1340.json), 1.49 + 0.61 with tf32 inside the diagonal
    blocks (KDA fwd+bwd 6.24 against 5.76). Removed.

Shape legend: T packed tokens, H heads, K key dim, V value dim, C chunk size, S sub-chunk size,
BD column block, BV value block, X 1 (GDN) or K (KDA), NC chunks over all sequences, NS = C / S.
"""
from __future__ import annotations

import triton
import triton.language as tl

from runtime.kernels.gated_delta.common import (
    block_diagonal, block_substitution, decayed_gram, diag_block_inverse, l2norm_rows, load_diag, merge_block_inverse,
    mm, row_of, unit_lower_inverse,
)


@triton.jit
def load_rows(ptr, tok_C, valid_C, H: tl.constexpr, D: tl.constexpr, head):
    """x_CD in fp32 from a packed [T, H, D] tensor; rows past the sequence end read as 0."""
    cols = tl.arange(0, D)
    offs = (tok_C.to(tl.int64) * H + head)[:, None] * D + cols[None, :]
    return tl.load(ptr + offs, mask=valid_C[:, None], other=0.0).to(tl.float32)


@triton.jit
def store_rows(ptr, x_CD, tok_C, valid_C, H: tl.constexpr, D: tl.constexpr, head):
    cols = tl.arange(0, D)
    offs = (tok_C.to(tl.int64) * H + head)[:, None] * D + cols[None, :]
    tl.store(ptr + offs, x_CD.to(ptr.dtype.element_ty), mask=valid_C[:, None])


@triton.jit
def load_gc(g_ptr, tok_C, valid_C, H: tl.constexpr, K: tl.constexpr, head, PER_CHANNEL: tl.constexpr):
    """In-chunk cumulative log decay gc_CX (X = K per channel, else 1); padded rows add 0."""
    if PER_CHANNEL:
        gc = tl.cumsum(load_rows(g_ptr, tok_C, valid_C, H, K, head), 0)
    else:
        g = tl.load(g_ptr + tok_C.to(tl.int64) * H + head, mask=valid_C, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, 0)[:, None]
    return gc


@triton.jit
def chunk_inputs(q_ptr, k_ptr, g_ptr, beta_ptr, tok_C, valid_C, head, scale, H: tl.constexpr,
                 K: tl.constexpr, PER_CHANNEL: tl.constexpr, L2NORM: tl.constexpr):
    """(q_hat * scale, k_hat, gc_CX, beta_C, q inverse norms, k inverse norms) of one chunk."""
    q, q_inv = l2norm_rows(load_rows(q_ptr, tok_C, valid_C, H, K, head), 1e-6, L2NORM)
    k, k_inv = l2norm_rows(load_rows(k_ptr, tok_C, valid_C, H, K, head), 1e-6, L2NORM)
    gc = load_gc(g_ptr, tok_C, valid_C, H, K, head, PER_CHANNEL)
    beta = tl.load(beta_ptr + tok_C.to(tl.int64) * H + head, mask=valid_C, other=0.0).to(tl.float32)
    return q * scale, k, gc, beta, q_inv, k_inv


@triton.jit
def chunk_tokens(chunk_start_ptr, chunk_end_ptr, chunk, C: tl.constexpr):
    start = tl.load(chunk_start_ptr + chunk)
    end = tl.load(chunk_end_ptr + chunk)
    tok = start + tl.arange(0, C)
    return tok, tok < end


@triton.jit
def rows_at(ptr, row0, head, H: tl.constexpr, D: tl.constexpr, col0, R: tl.constexpr, BD: tl.constexpr):
    """Pointers to rows row0 .. row0 + R, columns col0 .. col0 + BD of a packed [T, H, D] tensor for one
    head: a 64-bit scalar base plus 32-bit in-tile offsets (fewer registers than 64-bit offsets per element)."""
    base = ptr + (row0.to(tl.int64) * H + head) * D + col0
    return base + tl.arange(0, R)[:, None] * (H * D) + tl.arange(0, BD)[None, :]


@triton.jit
def scalar_diag_blocks(k_CK, gc_C, beta_C, C: tl.constexpr, S: tl.constexpr, PREC: tl.constexpr):
    """The S x S diagonal blocks of L (scalar decay), beta_i exp(gc_i - gc_j) k_i . k_j for j < i, as a
    [C / S, S, S] batch."""
    NS: tl.constexpr = C // S
    K: tl.constexpr = k_CK.shape[1]
    k_BSK = tl.reshape(k_CK, [NS, S, K])
    g_BS = tl.reshape(gc_C, [NS, S])
    ii = tl.arange(0, S)
    decay = tl.exp(tl.where((ii[:, None] > ii[None, :])[None, :, :], g_BS[:, :, None] - g_BS[:, None, :],
                            float("-inf")))
    gram = tl.dot(k_BSK, tl.permute(k_BSK, (0, 2, 1)), input_precision=PREC)
    return tl.reshape(beta_C, [NS, S])[:, :, None] * gram * decay


@triton.jit
def chunk_inverse(k, gc, beta, start, tok, valid, head, ldiag_ptr, tdiag_ptr, H: tl.constexpr, C: tl.constexpr,
                  S: tl.constexpr, PER_CHANNEL: tl.constexpr, SPLIT_DIAG: tl.constexpr, DOUBLING: tl.constexpr,
                  PREC: tl.constexpr):
    """Tinv_CC = (I + L)^-1 of one chunk, L = beta gram(k, k) strictly lower. The inverses of its S x S
    diagonal blocks: by doubling here (DOUBLING; per channel it needs SPLIT_DIAG), else from diagonal.py's
    kernel (SPLIT_DIAG), else by row substitution here. SPLIT_DIAG also reads L's per-channel diagonal
    blocks from diagonal.py's kernel."""
    if SPLIT_DIAG:
        l_mat = beta[:, None] * decayed_gram(k, k, gc, True, PER_CHANNEL, C, S, PREC, False)
        if PER_CHANNEL:
            l_mat += load_diag(ldiag_ptr, tok, valid, head, H, C, S)
    else:
        l_mat = beta[:, None] * decayed_gram(k, k, gc, True, PER_CHANNEL, C, S, PREC, True)
    if DOUBLING:
        if PER_CHANNEL:
            l_BSS = tl.reshape(load_cols(ldiag_ptr, start, valid, head, H, S, 0, C, S), [C // S, S, S])
        else:
            l_BSS = scalar_diag_blocks(k, tl.sum(gc, 1), beta, C, S, PREC)
        tinv = merge_block_inverse(l_mat, block_diagonal(diag_block_inverse(l_BSS, S, "tf32x3"), C, S), C, S, PREC)
    elif SPLIT_DIAG:
        tinv = block_substitution(l_mat, load_diag(tdiag_ptr, tok, valid, head, H, C, S), C, S, PREC)
    else:
        tinv = unit_lower_inverse(l_mat, C, S, PREC)
    return tinv


@triton.jit
def prep_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, chunk_start_ptr, chunk_end_ptr,
                qg_ptr, kbar_ptr, w_ptr, u_ptr, p_ptr, glast_ptr, tinv_ptr, ldiag_ptr, tdiag_ptr, pdiag_ptr, scale,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                PER_CHANNEL: tl.constexpr, L2NORM: tl.constexpr, STORE_TINV: tl.constexpr,
                SPLIT_DIAG: tl.constexpr, DOUBLING: tl.constexpr, PREC: tl.constexpr):
    """Per (chunk, head): qg = q exp(gc), kbar = k exp(gc_last - gc), w, u, P, gc_last [, Tinv], each
    stored in its buffer's dtype (see chunk_inverse for the diagonal blocks' sources).
    Ordered so that few [C, K] tiles are live at once: k first (through L, Tinv, w and P), v only for u,
    q only for qg and P."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    tok, valid = chunk_tokens(chunk_start_ptr, chunk_end_ptr, chunk, C)
    start = tl.load(chunk_start_ptr + chunk)
    k, _ = l2norm_rows(load_cols(k_ptr, start, valid, head, H, K, 0, C, K).to(tl.float32), 1e-6, L2NORM)
    gc = load_gc(g_ptr, tok, valid, H, K, head, PER_CHANNEL)
    beta = tl.load(beta_ptr + tok.to(tl.int64) * H + head, mask=valid, other=0.0).to(tl.float32)
    gl = row_of(gc, C - 1, C)
    store_last(glast_ptr, gl, chunk, head, H, K, PER_CHANNEL)
    store_cols(kbar_ptr, k * tl.exp(gl[None, :] - gc), start, valid, head, H, K, 0, K)
    tinv = chunk_inverse(k, gc, beta, start, tok, valid, head, ldiag_ptr, tdiag_ptr, H, C, S, PER_CHANNEL,
                         SPLIT_DIAG, DOUBLING, PREC)
    if STORE_TINV:
        store_cols(tinv_ptr, tinv, start, valid, head, H, C, 0, C)
    w = tl.dot(tinv, beta[:, None] * k * tl.exp(gc), input_precision=PREC)
    store_cols(w_ptr, w, start, valid, head, H, K, 0, K)
    v = load_cols(v_ptr, start, valid, head, H, V, 0, C, V).to(tl.float32)
    store_cols(u_ptr, tl.dot(tinv, beta[:, None] * v, input_precision=PREC), start, valid, head, H, V, 0, V)
    q, _ = l2norm_rows(load_cols(q_ptr, start, valid, head, H, K, 0, C, K).to(tl.float32), 1e-6, L2NORM)
    q = q * scale
    store_cols(qg_ptr, q * tl.exp(gc), start, valid, head, H, K, 0, K)
    if SPLIT_DIAG:
        p_mat = decayed_gram(q, k, gc, False, PER_CHANNEL, C, S, PREC, False)
        if PER_CHANNEL:
            p_mat += load_diag(pdiag_ptr, tok, valid, head, H, C, S)
    else:
        p_mat = decayed_gram(q, k, gc, False, PER_CHANNEL, C, S, PREC, True)
    store_cols(p_ptr, p_mat, start, valid, head, H, C, 0, C)


@triton.jit
def load_cols(ptr, row0, valid_C, head, H: tl.constexpr, D: tl.constexpr, col0, C: tl.constexpr, BD: tl.constexpr):
    """x_C,BD in its stored dtype: columns col0 .. col0 + BD of rows row0 .. row0 + C; invalid rows read 0."""
    return tl.load(rows_at(ptr, row0, head, H, D, col0, C, BD), mask=valid_C[:, None], other=0.0)


@triton.jit
def store_cols(ptr, x, row0, valid_C, head, H: tl.constexpr, D: tl.constexpr, col0, BD: tl.constexpr):
    C: tl.constexpr = x.shape[0]
    tl.store(rows_at(ptr, row0, head, H, D, col0, C, BD), x.to(ptr.dtype.element_ty), mask=valid_C[:, None])


@triton.jit
def raw_grams(q_ptr, k_ptr, g_ptr, start, valid, head, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
              S: tl.constexpr, BD: tl.constexpr, PER_CHANNEL: tl.constexpr, GRAM_PREC: tl.constexpr,
              PREC: tl.constexpr):
    """(k k^T, q k^T, the S x S diagonal blocks of k k^T as [C / S, S, S], |k|^2, |q|^2) of the raw (not
    normalized) rows, summed over [C, BD] column blocks. Per channel the Gram products carry the decay
    and leave their diagonal blocks 0 (diagonal.py's kernel sums those exactly; the third is then 0);
    the scalar decay multiplies it in afterwards."""
    NS: tl.constexpr = C // S
    kk_BSS = tl.zeros([NS, S, S], tl.float32)
    kk = tl.zeros([C, C], tl.float32)
    qk = tl.zeros([C, C], tl.float32)
    k_sq = tl.zeros([C], tl.float32)
    q_sq = tl.zeros([C], tl.float32)
    for col0 in tl.static_range(0, K, BD):
        k_blk = load_cols(k_ptr, start, valid, head, H, K, col0, C, BD)
        q_blk = load_cols(q_ptr, start, valid, head, H, K, col0, C, BD)
        k_sq += tl.sum(k_blk.to(tl.float32) * k_blk.to(tl.float32), 1)
        q_sq += tl.sum(q_blk.to(tl.float32) * q_blk.to(tl.float32), 1)
        if PER_CHANNEL:
            # the cumsum runs down each column: a column block's is the chunk's
            gc_blk = tl.cumsum(load_cols(g_ptr, start, valid, head, H, K, col0, C, BD).to(tl.float32), 0)
            kk += decayed_gram(k_blk.to(tl.float32), k_blk.to(tl.float32), gc_blk, True, True, C, S, PREC, False)
            qk += decayed_gram(q_blk.to(tl.float32), k_blk.to(tl.float32), gc_blk, False, True, C, S, PREC, False)
        else:
            kk += mm(k_blk, tl.trans(k_blk), GRAM_PREC)
            qk += mm(q_blk, tl.trans(k_blk), GRAM_PREC)
            # the diagonal blocks again as a batch: the doubling inverse wants them apart from kk
            k_BSD = tl.reshape(k_blk, [NS, S, BD])
            kk_BSS += mm(k_BSD, tl.permute(k_BSD, (0, 2, 1)), GRAM_PREC)
    return kk, qk, kk_BSS, k_sq, q_sq


@triton.jit
def prep_blocked_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, chunk_start_ptr, chunk_end_ptr,
                        qg_ptr, kbar_ptr, w_ptr, u_ptr, p_ptr, glast_ptr, tinv_ptr, inv_ptr, ldiag_ptr, pdiag_ptr,
                        scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                        BD: tl.constexpr, PER_CHANNEL: tl.constexpr,
                        L2NORM: tl.constexpr, STORE_TINV: tl.constexpr, COLUMNS: tl.constexpr,
                        STORE_NORMS: tl.constexpr, GRAM_PREC: tl.constexpr, DIAG_PREC: tl.constexpr,
                        PREC: tl.constexpr):
    """prep_kernel's outputs on [C, BD] column blocks: no [C, K] fp32 tile is live across the chunk's
    matrices. The Gram products take the raw inputs (bf16 operands are exact for bf16 inputs) and the
    l2norm scales them afterwards: gram(k_hat)_ij = (k_i . k_j) / (|k_i| |k_j|). The inverses of Tinv's
    diagonal blocks come from doubling (DIAG_PREC); per channel, L's and P's diagonal blocks from
    diagonal.py's kernel (run without its inverse). Without COLUMNS it stops at P and Tinv (stored, with the scalar
    gc_last): prep_columns_kernel makes the rest. STORE_NORMS stores the rows' inverse norms [T, H, 2] at inv_ptr (k's,
    then q's times the scale) for prep_columns_kernel and, with KernelVariant.stored_norms, the backward kernels."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(chunk_start_ptr + chunk), tl.load(chunk_end_ptr + chunk)
    rows = tl.arange(0, C)
    tok = start + rows
    valid = tok < end
    kk, qk, kk_BSS, k_sq, q_sq = raw_grams(q_ptr, k_ptr, g_ptr, start, valid, head, H, K, C, S, BD, PER_CHANNEL,
                                           GRAM_PREC, PREC)
    k_inv = tl.full([C], 1.0, tl.float32)
    q_inv = tl.full([C], 1.0, tl.float32)
    if L2NORM:
        k_inv = 1.0 / tl.sqrt(k_sq + 1e-6)
        q_inv = 1.0 / tl.sqrt(q_sq + 1e-6)
    q_inv = q_inv * scale
    beta = tl.load(beta_ptr + tok.to(tl.int64) * H + head, mask=valid, other=0.0).to(tl.float32)
    l_mat = (beta * k_inv)[:, None] * kk * k_inv[None, :]
    p_mat = q_inv[:, None] * qk * k_inv[None, :]
    # L's diagonal blocks apart, [C / S, S, S]: the merge below reads only l_mat's other blocks
    NS: tl.constexpr = C // S
    if PER_CHANNEL:
        l_BSS = tl.reshape(load_cols(ldiag_ptr, start, valid, head, H, S, 0, C, S), [NS, S, S])
        p_mat += load_diag(pdiag_ptr, tok, valid, head, H, C, S)
        gc = tl.zeros([C], tl.float32)
    else:
        gc = tl.cumsum(tl.load(g_ptr + tok.to(tl.int64) * H + head, mask=valid, other=0.0).to(tl.float32), 0)
        decay = tl.exp(tl.where(rows[:, None] >= rows[None, :], gc[:, None] - gc[None, :], float("-inf")))
        l_mat = tl.where(rows[:, None] > rows[None, :], l_mat * decay, 0.0)
        p_mat = p_mat * decay
        tl.store(glast_ptr + chunk.to(tl.int64) * H + head, tl.sum(tl.where(rows == C - 1, gc, 0.0), 0))
        g_BS = tl.reshape(gc, [NS, S])
        row_scale = tl.reshape(beta * k_inv, [NS, S])
        col_scale = tl.reshape(k_inv, [NS, S])
        ii = tl.arange(0, S)
        diag_decay = tl.exp(tl.where((ii[:, None] > ii[None, :])[None, :, :], g_BS[:, :, None] - g_BS[:, None, :],
                                     float("-inf")))
        l_BSS = row_scale[:, :, None] * kk_BSS * col_scale[:, None, :] * diag_decay
    store_cols(p_ptr, p_mat, start, valid, head, H, C, 0, C)
    tinv = merge_block_inverse(l_mat, block_diagonal(diag_block_inverse(l_BSS, S, DIAG_PREC), C, S), C, S, PREC)
    if STORE_TINV:
        store_cols(tinv_ptr, tinv, start, valid, head, H, C, 0, C)
    if STORE_NORMS:
        # the programs of the column kernel and of the backward would each re-read q and k whole for them
        inv_offs = (tok.to(tl.int64) * H + head) * 2
        tl.store(inv_ptr + inv_offs, k_inv, mask=valid)
        tl.store(inv_ptr + inv_offs + 1, q_inv, mask=valid)
    if COLUMNS:
        for col0 in tl.static_range(0, K, BD):
            key_columns(q_ptr, k_ptr, g_ptr, kbar_ptr, w_ptr, qg_ptr, glast_ptr, tinv, beta, k_inv, q_inv, gc,
                        start, valid, chunk, head, col0, H, K, C, BD, PER_CHANNEL, PREC)
        for col0 in tl.static_range(0, V, BD):
            value_columns(v_ptr, u_ptr, tinv, beta, start, valid, head, col0, H, V, BD, PREC)


@triton.jit
def prep_columns_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, chunk_start_ptr, chunk_end_ptr, tinv_ptr, inv_ptr,
                        qg_ptr, kbar_ptr, w_ptr, u_ptr, glast_ptr, H: tl.constexpr, K: tl.constexpr,
                        V: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, PER_CHANNEL: tl.constexpr,
                        PREC: tl.constexpr):
    """Per (chunk, head, column block), after prep_blocked_kernel without COLUMNS (KernelVariant.split_prep):
    kbar, w, qg (per channel gc_last) of key columns, or u of value columns, from the stored Tinv. Apart, the
    Gram-and-inverse kernel holds no column tiles and this one no Gram products: fewer registers each, and
    (K + V) / BD programs per chunk and head share the column work."""
    chunk, head, blk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = tl.load(chunk_start_ptr + chunk), tl.load(chunk_end_ptr + chunk)
    tok = start + tl.arange(0, C)
    valid = tok < end
    # padded rows read 0; Tinv is lower triangular, so the valid rows never reach them
    tinv = load_cols(tinv_ptr, start, valid, head, H, C, 0, C, C).to(tl.float32)
    beta = tl.load(beta_ptr + tok.to(tl.int64) * H + head, mask=valid, other=0.0).to(tl.float32)
    if blk < K // BD:
        # k's and q's inverse norms (q's with the scale) as prep_blocked_kernel stored them
        inv_offs = (tok.to(tl.int64) * H + head) * 2
        k_inv = tl.load(inv_ptr + inv_offs, mask=valid, other=0.0)
        q_inv = tl.load(inv_ptr + inv_offs + 1, mask=valid, other=0.0)
        gc = tl.zeros([C], tl.float32)
        if not PER_CHANNEL:
            gc = tl.cumsum(tl.load(g_ptr + tok.to(tl.int64) * H + head, mask=valid, other=0.0).to(tl.float32), 0)
        key_columns(q_ptr, k_ptr, g_ptr, kbar_ptr, w_ptr, qg_ptr, glast_ptr, tinv, beta, k_inv, q_inv, gc, start,
                    valid, chunk, head, blk * BD, H, K, C, BD, PER_CHANNEL, PREC)
    else:
        value_columns(v_ptr, u_ptr, tinv, beta, start, valid, head, (blk - K // BD) * BD, H, V, BD, PREC)


@triton.jit
def key_columns(q_ptr, k_ptr, g_ptr, kbar_ptr, w_ptr, qg_ptr, glast_ptr, tinv, beta, k_inv, q_inv, gc, start, valid,
                chunk, head, col0, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BD: tl.constexpr,
                PER_CHANNEL: tl.constexpr, PREC: tl.constexpr):
    """prep_blocked_kernel's key-side outputs of columns col0 .. col0 + BD: kbar, w, qg (per channel gc_last)."""
    rows = tl.arange(0, C)
    if PER_CHANNEL:
        gc_blk = tl.cumsum(load_cols(g_ptr, start, valid, head, H, K, col0, C, BD).to(tl.float32), 0)
        gl_blk = row_of(gc_blk, C - 1, C)
        tl.store(glast_ptr + (chunk.to(tl.int64) * H + head) * K + col0 + tl.arange(0, BD), gl_blk)
        kbar_decay = tl.exp(gl_blk[None, :] - gc_blk)
    else:
        gc_blk = gc[:, None]
        kbar_decay = tl.exp(tl.sum(tl.where(rows == C - 1, gc, 0.0), 0) - gc_blk)
    e_g = tl.exp(gc_blk)
    k_hat = load_cols(k_ptr, start, valid, head, H, K, col0, C, BD).to(tl.float32) * k_inv[:, None]
    store_cols(kbar_ptr, k_hat * kbar_decay, start, valid, head, H, K, col0, BD)
    w_blk = tl.dot(tinv, beta[:, None] * k_hat * e_g, input_precision=PREC)
    store_cols(w_ptr, w_blk, start, valid, head, H, K, col0, BD)
    q_blk = load_cols(q_ptr, start, valid, head, H, K, col0, C, BD).to(tl.float32)
    store_cols(qg_ptr, q_blk * q_inv[:, None] * e_g, start, valid, head, H, K, col0, BD)


@triton.jit
def value_columns(v_ptr, u_ptr, tinv, beta, start, valid, head, col0, H: tl.constexpr, V: tl.constexpr,
                  BD: tl.constexpr, PREC: tl.constexpr):
    """u = Tinv (beta v) of columns col0 .. col0 + BD."""
    C: tl.constexpr = tinv.shape[0]
    v_blk = load_cols(v_ptr, start, valid, head, H, V, col0, C, BD).to(tl.float32)
    u_blk = tl.dot(tinv, beta[:, None] * v_blk, input_precision=PREC)
    store_cols(u_ptr, u_blk, start, valid, head, H, V, col0, BD)

@triton.jit
def state_offsets(index, head, col0, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Offsets of the [K, BV] block of state `index` (of [*, H, K, V]) for this head."""
    base = (index.to(tl.int64) * H + head) * K * V
    return base + tl.arange(0, K)[:, None] * V + col0 + tl.arange(0, BV)[None, :]


@triton.jit
def store_last(glast_ptr, gl_X, chunk, head, H: tl.constexpr, K: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """The chunk's total log decay into [NC, H, X]."""
    if PER_CHANNEL:
        tl.store(glast_ptr + (chunk.to(tl.int64) * H + head) * K + tl.arange(0, K), gl_X)
    else:
        tl.store(glast_ptr + chunk.to(tl.int64) * H + head, tl.sum(gl_X, 0))


@triton.jit
def load_chunk_decay(glast_ptr, chunk, head, H: tl.constexpr, K: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """exp(gc_last) of a chunk, shaped to scale a [K, BV] state: [K, 1] per channel, else [1, 1]."""
    if PER_CHANNEL:
        decay = tl.exp(tl.load(glast_ptr + (chunk.to(tl.int64) * H + head) * K + tl.arange(0, K)))[:, None]
    else:
        decay = tl.exp(tl.load(glast_ptr + chunk.to(tl.int64) * H + head + tl.zeros([1, 1], tl.int32)))
    return decay


@triton.jit
def scan_kernel(w_ptr, u_ptr, kbar_ptr, glast_ptr, h0_ptr, qg_ptr, p_ptr, cu_ptr, chunk_offsets_ptr,
                h_ptr, vnew_ptr, ht_ptr, o_ptr,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                PER_CHANNEL: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
                OUTPUT: tl.constexpr, PREC: tl.constexpr):
    """Per (sequence, head, V block), chunk by chunk: store the entering state h, then
    v_new = u - w h and h <- exp(gc_last) h + kbar^T v_new. State in fp32 registers; the products
    take their operands in PREC (see common.mm: "bf16" rounds h and v_new as their stored copies are).
    With OUTPUT also o = qg h + P v_new of the chunk (KernelVariant.scan_output: no output_kernel), on h and
    v_new rounded to their buffers' dtypes as output_kernel reads them back."""
    seq, head, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = tl.load(cu_ptr + seq), tl.load(cu_ptr + seq + 1)
    first_chunk = tl.load(chunk_offsets_ptr + seq)
    col0 = vb * BV
    seq_offs = state_offsets(seq, head, col0, H, K, V, BV)
    h = tl.zeros([K, BV], tl.float32)
    if HAS_H0:
        h += tl.load(h0_ptr + seq_offs)
    for c in range(tl.cdiv(eos - bos, C)):
        chunk = first_chunk + c
        h_stored = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + state_offsets(chunk, head, col0, H, K, V, BV), h_stored)
        row0 = bos + c * C
        valid = (row0 + tl.arange(0, C) < eos)[:, None]
        w = tl.load(rows_at(w_ptr, row0, head, H, K, 0, C, K), mask=valid, other=0.0)
        u = tl.load(rows_at(u_ptr, row0, head, H, V, col0, C, BV), mask=valid, other=0.0)
        v_new = u.to(tl.float32) - mm(w, h, PREC)
        v_stored = v_new.to(vnew_ptr.dtype.element_ty)
        tl.store(rows_at(vnew_ptr, row0, head, H, V, col0, C, BV), v_stored, mask=valid)
        kbar = tl.load(rows_at(kbar_ptr, row0, head, H, K, 0, C, K), mask=valid, other=0.0)
        decay = load_chunk_decay(glast_ptr, chunk, head, H, K, PER_CHANNEL)
        h = decay * h + mm(tl.trans(kbar), v_new, PREC)
        if OUTPUT:
            # after the state update, which then waits on neither o's products nor its store (the warps still
            # issue them before the next chunk's w h); the pipeliner prefetches qg and P with w, u and kbar
            qg = tl.load(rows_at(qg_ptr, row0, head, H, K, 0, C, K), mask=valid, other=0.0)
            p = tl.load(rows_at(p_ptr, row0, head, H, C, 0, C, C), mask=valid, other=0.0)
            o = mm(qg, h_stored, PREC) + mm(p, v_stored, PREC)
            tl.store(rows_at(o_ptr, row0, head, H, V, col0, C, BV), o.to(o_ptr.dtype.element_ty), mask=valid)
    if STORE_FINAL:
        tl.store(ht_ptr + seq_offs, h)


@triton.jit
def output_kernel(qg_ptr, p_ptr, h_ptr, vnew_ptr, chunk_start_ptr, chunk_end_ptr, o_ptr,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                  PREC: tl.constexpr):
    """Per (chunk, head, V block): o = qg h + P v_new, operands in their stored dtype (see common.mm)."""
    chunk, head, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = tl.load(chunk_start_ptr + chunk), tl.load(chunk_end_ptr + chunk)
    valid = (start + tl.arange(0, C) < end)[:, None]
    col0 = vb * BV
    h = tl.load(h_ptr + state_offsets(chunk, head, col0, H, K, V, BV))
    qg = tl.load(rows_at(qg_ptr, start, head, H, K, 0, C, K), mask=valid, other=0.0)
    p = tl.load(rows_at(p_ptr, start, head, H, C, 0, C, C), mask=valid, other=0.0)
    v_new = tl.load(rows_at(vnew_ptr, start, head, H, V, col0, C, BV), mask=valid, other=0.0)
    o = mm(qg, h, PREC) + mm(p, v_new, PREC)
    tl.store(rows_at(o_ptr, start, head, H, V, col0, C, BV), o.to(o_ptr.dtype.element_ty), mask=valid)
