"""Forward Triton kernels of the chunked gated delta rule (GDN scalar decay / KDA per-channel decay).

`prep_blocked_kernel` (every chunk in parallel, on [C, BD] column blocks so that no [C, K] fp32 tile stays
live: l2norm, decay cumsum, the UT inverse Tinv, then w, u, P, qg, kbar from Tinv in registers; for the scalar
decay qg's and kbar's factors by row instead of the tiles), then
`scan_kernel` (one program per sequence, head and V block walks the chunks: the states, v_new and o). KDA's exact
diagonal blocks of L and P's Gram products come from diagonal.py before prep. See runtime/ops/gated_delta/torch_form.py for the
algebra. Tokens are packed [T, H, *] (batch folded into T, sequences given by cu_seqlens).

Shape legend: T packed tokens, H heads, K key dim, V value dim, C chunk size, S sub-chunk size,
BD column block of the Gram products, BC of the column outputs, BV value block, X 1 (GDN) or K (KDA), NC chunks over
all sequences, NS = C / S.
"""
from __future__ import annotations

import triton
import triton.language as tl

from runtime.ops.gated_delta.common import (
    LOG2E, block_diagonal, decayed_grams, diag_block_inverse, load_diag, merge_block_inverse, mm, row_of,
)


@triton.jit
def chunk_tokens(chunk_start_ptr, chunk_end_ptr, chunk, C: tl.constexpr):
    """(first token, the C tokens, which of them are in the chunk) of a chunk."""
    start = tl.load(chunk_start_ptr + chunk)
    end = tl.load(chunk_end_ptr + chunk)
    tok = start + tl.arange(0, C)
    return start, tok, tok < end


@triton.jit
def rows_at(ptr, row0, head, H: tl.constexpr, D: tl.constexpr, col0, R: tl.constexpr, BD: tl.constexpr):
    """Pointers to rows row0 .. row0 + R, columns col0 .. col0 + BD of a packed [T, H, D] tensor for one
    head: a 64-bit scalar base plus 32-bit in-tile offsets (fewer registers than 64-bit offsets per element)."""
    base = ptr + (row0.to(tl.int64) * H + head) * D + col0
    return base + tl.arange(0, R)[:, None] * (H * D) + tl.arange(0, BD)[None, :]


@triton.jit
def load_cols(ptr, start, valid_R, head, col0, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
              BD: tl.constexpr):
    """x_R,BD in fp32: rows start .. start + R, columns col0 .. col0 + BD of a packed [T, H, D] tensor (see
    rows_at); rows past the sequence end read as 0."""
    return tl.load(rows_at(ptr, start, head, H, D, col0, R, BD), mask=valid_R[:, None], other=0.0).to(tl.float32)


@triton.jit
def store_cols(ptr, x, start, valid_R, head, col0, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
               BD: tl.constexpr):
    tl.store(rows_at(ptr, start, head, H, D, col0, R, BD), x.to(ptr.dtype.element_ty), mask=valid_R[:, None])


@triton.jit
def add_cols(ptr, x, start, valid_R, head, col0, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BD: tl.constexpr):
    """Adds x_R,BD to the fp32 rows of a packed [T, H, D] tensor (load_cols' block), in place."""
    store_cols(ptr, x + load_cols(ptr, start, valid_R, head, col0, H, D, R, BD), start, valid_R, head, col0, H, D,
               R, BD)


@triton.jit
def raw_grams(q_ptr, k_ptr, start, valid, head, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BD: tl.constexpr,
              GRAM_PREC: tl.constexpr):
    """(k k^T, q k^T, |k|^2, |q|^2) of the raw (not normalized) rows, summed over [C, BD] column blocks; the
    scalar decay multiplies it in afterwards."""
    kk = tl.zeros([C, C], tl.float32)
    qk = tl.zeros([C, C], tl.float32)
    k_sq = tl.zeros([C], tl.float32)
    q_sq = tl.zeros([C], tl.float32)
    for col0 in tl.static_range(0, K, BD):
        # in their stored dtype: bf16 Gram operands are exact for bf16 inputs
        k_blk = tl.load(rows_at(k_ptr, start, head, H, K, col0, C, BD), mask=valid[:, None], other=0.0)
        q_blk = tl.load(rows_at(q_ptr, start, head, H, K, col0, C, BD), mask=valid[:, None], other=0.0)
        k_sq += tl.sum(k_blk.to(tl.float32) * k_blk.to(tl.float32), 1)
        q_sq += tl.sum(q_blk.to(tl.float32) * q_blk.to(tl.float32), 1)
        kk += mm(k_blk, tl.trans(k_blk), GRAM_PREC)
        qk += mm(q_blk, tl.trans(k_blk), GRAM_PREC)
    return kk, qk, k_sq, q_sq


@triton.jit
def raw_decayed_grams(q_ptr, k_ptr, g_ptr, start, valid, head, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                      S: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    """raw_grams with the per-channel decay between sub-chunks (common.decayed_grams), whose diagonal blocks stay
    0: diagonal.py's kernel sums those exactly. A loop, not unrolled: the column blocks are narrow (registers)."""
    NS: tl.constexpr = C // S
    kk = tl.zeros([NS, S, C], tl.float32)
    qk = tl.zeros([NS, S, C], tl.float32)
    k_sq = tl.zeros([C], tl.float32)
    q_sq = tl.zeros([C], tl.float32)
    for col0 in range(0, K, BD):
        k_blk = load_cols(k_ptr, start, valid, head, col0, H, K, C, BD)
        q_blk = load_cols(q_ptr, start, valid, head, col0, H, K, C, BD)
        k_sq += tl.sum(k_blk * k_blk, 1)
        q_sq += tl.sum(q_blk * q_blk, 1)
        # the cumsum runs down each column: a column block's is the chunk's; log2 units for exp2
        gc_blk = tl.cumsum(load_cols(g_ptr, start, valid, head, col0, H, K, C, BD), 0) * LOG2E
        kk_blk, qk_blk = decayed_grams(k_blk, q_blk, gc_blk, C, S, PREC)
        kk += kk_blk
        qk += qk_blk
    return tl.reshape(kk, [C, C]), tl.reshape(qk, [C, C]), k_sq, q_sq


@triton.jit
def prep_blocked_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, chunk_start_ptr, chunk_end_ptr,
                        qg_ptr, kbar_ptr, w_ptr, u_ptr, p_ptr, glast_ptr, tinv_ptr, inv_ptr, ldiag_ptr, pdiag_ptr,
                        row_scales_ptr, scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                        S: tl.constexpr, BD: tl.constexpr, BC: tl.constexpr, PER_CHANNEL: tl.constexpr,
                        L2NORM: tl.constexpr, TILE_PREC: tl.constexpr, PREC: tl.constexpr):
    """Per (chunk, head): qg = q exp(gc), kbar = k exp(gc_last - gc), w, u, P, gc_last [, Tinv] in their buffers'
    dtypes; the Gram products on [C, BD] column blocks, the column outputs on [C, BC] ones. For the scalar decay
    qg and kbar are q and k with one factor a row: their factors [T, H, 2] (kbar's, then qg's) go to
    row_scales_ptr instead, and the scans apply them. The Gram products take the raw inputs and the l2norm scales
    them afterwards: gram(k_hat)_ij = (k_i . k_j) / (|k_i| |k_j|). Those raw products and the column outputs' (w, u:
    Tinv times a column block) take TILE_PREC (common.mm's; bf16 operands for bf16 inputs: exact for the raw
    Grams, and for w and u Tinv rounded as a stored tile); the decayed Grams and the inverse take PREC.
    The inverses of Tinv's diagonal blocks come from doubling; per channel, L's and P's diagonal blocks from
    diagonal.py. Tinv [T, H, C] and the rows' inverse norms [T, H, 2] at inv_ptr (k's, then q's times the scale)
    are stored for the backward unless their pointer is None."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    start, tok, valid = chunk_tokens(chunk_start_ptr, chunk_end_ptr, chunk, C)
    rows = tl.arange(0, C)
    if PER_CHANNEL:
        kk, qk, k_sq, q_sq = raw_decayed_grams(q_ptr, k_ptr, g_ptr, start, valid, head, H, K, C, S, BD, PREC)
    else:
        kk, qk, k_sq, q_sq = raw_grams(q_ptr, k_ptr, start, valid, head, H, K, C, BD, TILE_PREC)
    k_inv = 1.0 / tl.sqrt(k_sq + 1e-6) if L2NORM else tl.full([C], 1.0, tl.float32)
    q_inv = (1.0 / tl.sqrt(q_sq + 1e-6) if L2NORM else tl.full([C], 1.0, tl.float32)) * scale
    beta = tl.load(beta_ptr + tok.to(tl.int64) * H + head, mask=valid, other=0.0).to(tl.float32)
    l_mat = (beta * k_inv)[:, None] * kk * k_inv[None, :]
    p_mat = q_inv[:, None] * qk * k_inv[None, :]
    # L's diagonal blocks apart, [C / S, S, S]: the merge below reads only l_mat's other blocks
    NS: tl.constexpr = C // S
    if PER_CHANNEL:
        # diagonal.py's blocks are products of the raw rows too: the same scales make them L's and P's (column c
        # of block b belongs to token b S + c)
        l_BSS = tl.reshape(load_cols(ldiag_ptr, start, valid, head, 0, H, S, C, S) * (beta * k_inv)[:, None],
                           [NS, S, S]) * tl.reshape(k_inv, [NS, 1, S])
        p_mat += q_inv[:, None] * load_diag(pdiag_ptr, tok, valid, head, H, C, S) * k_inv[None, :]
    else:
        gc = tl.cumsum(tl.load(g_ptr + tok.to(tl.int64) * H + head, mask=valid, other=0.0).to(tl.float32), 0)
        decay = tl.exp(tl.where(rows[:, None] >= rows[None, :], gc[:, None] - gc[None, :], float("-inf")))
        l_mat = tl.where(rows[:, None] > rows[None, :], l_mat * decay, 0.0)
        p_mat = p_mat * decay
        gl = tl.sum(tl.where(rows == C - 1, gc, 0.0), 0)
        tl.store(glast_ptr + chunk.to(tl.int64) * H + head, gl)
        scales_offs = (tok.to(tl.int64) * H + head) * 2
        tl.store(row_scales_ptr + scales_offs, k_inv * tl.exp(gl - gc), mask=valid)
        tl.store(row_scales_ptr + scales_offs + 1, q_inv * tl.exp(gc), mask=valid)
        blk = tl.arange(0, NS)
        same = blk[:, None, None, None] == blk[None, None, :, None]
        l_BSS = tl.sum(tl.where(same, tl.reshape(l_mat, [NS, S, NS, S]), 0.0), 2)
    store_cols(p_ptr, p_mat, start, valid, head, 0, H, C, C, C)
    # the doubling's partial products cancel where keys repeat: they want fp32 accuracy
    tinv = merge_block_inverse(l_mat, block_diagonal(diag_block_inverse(l_BSS, S, "tf32x3"), C, S), C, S, PREC)
    if tinv_ptr is not None:
        store_cols(tinv_ptr, tinv, start, valid, head, 0, H, C, C, C)
    if inv_ptr is not None:
        # the programs of the column kernel and of the backward would each re-read q and k whole for them
        inv_offs = (tok.to(tl.int64) * H + head) * 2
        tl.store(inv_ptr + inv_offs, k_inv, mask=valid)
        tl.store(inv_ptr + inv_offs + 1, q_inv, mask=valid)
    # the column outputs from Tinv in registers, in [C, BC] blocks. Per channel each key block's cumsum is taken
    # again from g (an L2 read): the Gram loop's [C, K] gc held across the inverse would cost K / 2 registers a
    # thread at 4 warps. The chunk's bounds are read again too: the column blocks' addresses and row masks are then
    # made after the inverse, not kept live across it
    start, tok, valid = chunk_tokens(chunk_start_ptr, chunk_end_ptr, chunk, C)
    for col0 in tl.static_range(0, K, BC):
        if PER_CHANNEL:
            gc_blk = tl.cumsum(load_cols(g_ptr, start, valid, head, col0, H, K, C, BC), 0)
            gl_blk = row_of(gc_blk, C - 1, C)
            tl.store(glast_ptr + (chunk.to(tl.int64) * H + head) * K + col0 + tl.arange(0, BC), gl_blk)
            key_columns(q_ptr, k_ptr, kbar_ptr, w_ptr, qg_ptr, tinv, beta, k_inv, q_inv, gc_blk, gl_blk[None, :],
                        start, valid, head, col0, H, K, C, BC, TILE_PREC)
        else:
            key_columns(q_ptr, k_ptr, None, w_ptr, None, tinv, beta, k_inv, q_inv, gc[:, None], gl, start, valid,
                        head, col0, H, K, C, BC, TILE_PREC)
    for col0 in tl.static_range(0, V, BC):
        value_columns(v_ptr, u_ptr, tinv, beta, start, valid, head, col0, H, V, BC, TILE_PREC)


@triton.jit
def key_columns(q_ptr, k_ptr, kbar_ptr, w_ptr, qg_ptr, tinv, beta, k_inv, q_inv, gc_CX, gl, start, valid, head, col0,
                H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    """The key-side outputs kbar, w, qg of columns col0 .. col0 + BD, given the cumulative decay gc_CX of those
    columns and gc_last (gl: [1, BD] per channel, a scalar for the scalar decay); w alone where kbar_ptr and qg_ptr
    are None."""
    e_g = tl.exp(gc_CX)
    k_hat = load_cols(k_ptr, start, valid, head, col0, H, K, C, BD) * k_inv[:, None]
    if kbar_ptr is not None:
        store_cols(kbar_ptr, k_hat * tl.exp(gl - gc_CX), start, valid, head, col0, H, K, C, BD)
    w_blk = mm(tinv, beta[:, None] * k_hat * e_g, PREC)
    store_cols(w_ptr, w_blk, start, valid, head, col0, H, K, C, BD)
    if qg_ptr is not None:
        q_blk = load_cols(q_ptr, start, valid, head, col0, H, K, C, BD)
        store_cols(qg_ptr, q_blk * q_inv[:, None] * e_g, start, valid, head, col0, H, K, C, BD)


@triton.jit
def value_columns(v_ptr, u_ptr, tinv, beta, start, valid, head, col0, H: tl.constexpr, V: tl.constexpr,
                  BD: tl.constexpr, PREC: tl.constexpr):
    """u = Tinv (beta v) of columns col0 .. col0 + BD."""
    C: tl.constexpr = tinv.shape[0]
    v_blk = load_cols(v_ptr, start, valid, head, col0, H, V, C, BD)
    u_blk = mm(tinv, beta[:, None] * v_blk, PREC)
    store_cols(u_ptr, u_blk, start, valid, head, col0, H, V, C, BD)


@triton.jit
def state_offsets(index, head, row0, col0, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr):
    """Offsets of the [BK, BV] block at (row0, col0) of state `index` (of [*, H, K, V]) for this head."""
    base = (index.to(tl.int64) * H + head) * K * V
    return base + (row0 + tl.arange(0, BK))[:, None] * V + col0 + tl.arange(0, BV)[None, :]


@triton.jit
def load_chunk_log_decay(glast_ptr, chunk, head, H: tl.constexpr, K: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """gc_last of a chunk, shaped so that its exp scales a [K, BV] state: [K, 1] per channel, else a scalar (a
    [1, 1] tile is loaded once per element of the state that each thread holds). The callers take the exp where
    they use it: the warps then wait on the load there, not where it is issued."""
    if PER_CHANNEL:
        gl = tl.load(glast_ptr + (chunk.to(tl.int64) * H + head) * K + tl.arange(0, K))[:, None]
    else:
        gl = tl.load(glast_ptr + chunk.to(tl.int64) * H + head)
    return gl


@triton.jit
def load_row_scales(row_scales_ptr, row0, bos, eos, head, H: tl.constexpr, C: tl.constexpr):
    """(kbar's, qg's) factors [C, 1] fp32 of rows row0 .. row0 + C from prep's row scales [T, H, 2]; rows outside
    the sequence bos .. eos read 0."""
    rows = row0 + tl.arange(0, C)[:, None]
    offs = (rows.to(tl.int64) * H + head) * 2
    inside = (rows >= bos) & (rows < eos)
    return (tl.load(row_scales_ptr + offs, mask=inside, other=0.0),
            tl.load(row_scales_ptr + offs + 1, mask=inside, other=0.0))


@triton.jit
def scan_start(cu_ptr, chunk_offsets_ptr, s0_ptr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BV: tl.constexpr):
    """(head, first token, end, first chunk, first value column, offsets of the [K, BV] block of a state
    [N, H, K, V], s0's block in fp32 or 0 where s0_ptr is None) of a scan program (sequence, head, V block)."""
    seq, head, col0 = tl.program_id(0), tl.program_id(1), tl.program_id(2) * BV
    seq_offs = state_offsets(seq, head, 0, col0, H, K, V, K, BV)
    s = tl.zeros([K, BV], tl.float32)
    if s0_ptr is not None:
        s += tl.load(s0_ptr + seq_offs)
    return head, tl.load(cu_ptr + seq), tl.load(cu_ptr + seq + 1), tl.load(chunk_offsets_ptr + seq), col0, seq_offs, s


@triton.jit
def scan_kernel(w_ptr, u_ptr, kbar_ptr, glast_ptr, h0_ptr, qg_ptr, p_ptr, row_scales_ptr, cu_ptr,
                chunk_offsets_ptr, h_ptr, vnew_ptr, ht_ptr, o_ptr,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                PER_CHANNEL: tl.constexpr, PREC: tl.constexpr):
    """Per (sequence, head, V block), chunk by chunk: store the entering state h, then
    v_new = u - w h and h <- exp(gc_last) h + kbar^T v_new. State in fp32 registers; the products
    take their operands in PREC (see common.mm: "bf16" rounds h and v_new as their stored copies are).
    Also o = qg h + P v_new of the chunk, on h and v_new rounded as their stored copies are; the final state
    fp32 at ht_ptr, starting from h0 unless h0_ptr is None. h and v_new are not stored where h_ptr and vnew_ptr
    are None (no backward). With row_scales_ptr (the scalar decay) kbar_ptr and qg_ptr hold k and q, and their
    factors by row scale v_new in the state's product and q h in o's."""
    head, bos, eos, first_chunk, col0, seq_offs, h = scan_start(cu_ptr, chunk_offsets_ptr, h0_ptr, H, K, V, BV)
    if row_scales_ptr is not None:
        # each step loads the next chunk's factors, a whole step before their use: loaded in the step that uses
        # them, their latency stays in every step (the pipeliner does not prefetch them)
        k_next, q_next = load_row_scales(row_scales_ptr, bos, bos, eos, head, H, C)
    for c in range(tl.cdiv(eos - bos, C)):
        chunk = first_chunk + c
        row0 = bos + c * C
        valid = (row0 + tl.arange(0, C) < eos)[:, None]
        # issued first: its latency then passes under the state's store and w h instead of before the update
        gl = load_chunk_log_decay(glast_ptr, chunk, head, H, K, PER_CHANNEL)
        if row_scales_ptr is not None:
            k_scale, q_scale = k_next, q_next
            k_next, q_next = load_row_scales(row_scales_ptr, row0 + C, bos, eos, head, H, C)
        # h, v_new and w share the storage dtype: o takes the same rounding whether or not they are stored
        h_stored = h.to(w_ptr.dtype.element_ty)
        if h_ptr is not None:
            tl.store(h_ptr + state_offsets(chunk, head, 0, col0, H, K, V, K, BV), h_stored)
        w = tl.load(rows_at(w_ptr, row0, head, H, K, 0, C, K), mask=valid, other=0.0)
        u = tl.load(rows_at(u_ptr, row0, head, H, V, col0, C, BV), mask=valid, other=0.0)
        v_new = u.to(tl.float32) - mm(w, h, PREC)
        v_stored = v_new.to(w_ptr.dtype.element_ty)
        if vnew_ptr is not None:
            tl.store(rows_at(vnew_ptr, row0, head, H, V, col0, C, BV), v_stored, mask=valid)
        kbar = tl.load(rows_at(kbar_ptr, row0, head, H, K, 0, C, K), mask=valid, other=0.0)
        if row_scales_ptr is not None:
            h = tl.exp(gl) * h + mm(tl.trans(kbar), v_new * k_scale, PREC)
        else:
            h = tl.exp(gl) * h + mm(tl.trans(kbar), v_new, PREC)
        # after the state update, which then waits on neither o's products nor its store (the warps still
        # issue them before the next chunk's w h); the pipeliner prefetches qg and P with w, u and kbar
        qg = tl.load(rows_at(qg_ptr, row0, head, H, K, 0, C, K), mask=valid, other=0.0)
        p = tl.load(rows_at(p_ptr, row0, head, H, C, 0, C, C), mask=valid, other=0.0)
        o_state = mm(qg, h_stored, PREC)
        if row_scales_ptr is not None:
            o_state *= q_scale
        o = o_state + mm(p, v_stored, PREC)
        tl.store(rows_at(o_ptr, row0, head, H, V, col0, C, BV), o.to(o_ptr.dtype.element_ty), mask=valid)
    tl.store(ht_ptr + seq_offs, h)
