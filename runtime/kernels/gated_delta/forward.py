"""Forward Triton kernels of the chunked gated delta rule (GDN scalar decay / KDA per-channel decay).

Three launches: `prep_kernel` (every chunk in parallel: l2norm, decay cumsum, UT inverse, w, u, P;
after diagonal.py's `diag_kernel` in the split-diagonal variant),
`scan_kernel` (one program per sequence, head and V block walks the chunks: states and v_new),
`output_kernel` (every chunk in parallel: o = (q exp(gc)) h + P v_new). See runtime/ops/gated_delta.py
for the algebra. Tokens are packed [T, H, *] (batch folded into T, sequences given by cu_seqlens).

Shape legend: T packed tokens, H heads, K key dim, V value dim, C chunk size, S sub-chunk size,
BV value block, X 1 (GDN) or K (KDA), NC chunks over all sequences.
"""
from __future__ import annotations

import triton
import triton.language as tl

from runtime.kernels.gated_delta.common import (
    block_substitution, decayed_gram, l2norm_rows, load_diag, row_of, unit_lower_inverse,
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
def chunk_matrices(q, k, gc, beta, tok, valid, head, ldiag_ptr, tdiag_ptr, pdiag_ptr, H: tl.constexpr,
                   C: tl.constexpr, S: tl.constexpr, PER_CHANNEL: tl.constexpr, SPLIT_DIAG: tl.constexpr,
                   PREC: tl.constexpr):
    """(Tinv_CC, P_CC) of one chunk; with SPLIT_DIAG the diagonal blocks come from diagonal.py's kernel."""
    if SPLIT_DIAG:
        l_mat = beta[:, None] * decayed_gram(k, k, gc, True, PER_CHANNEL, C, S, PREC, False)
        p_mat = decayed_gram(q, k, gc, False, PER_CHANNEL, C, S, PREC, False)
        if PER_CHANNEL:
            l_mat += load_diag(ldiag_ptr, tok, valid, head, H, C, S)
            p_mat += load_diag(pdiag_ptr, tok, valid, head, H, C, S)
        tinv = block_substitution(l_mat, load_diag(tdiag_ptr, tok, valid, head, H, C, S), C, S, PREC)
    else:
        l_mat = beta[:, None] * decayed_gram(k, k, gc, True, PER_CHANNEL, C, S, PREC, True)
        tinv = unit_lower_inverse(l_mat, C, S, PREC)
        p_mat = decayed_gram(q, k, gc, False, PER_CHANNEL, C, S, PREC, True)
    return tinv, p_mat


@triton.jit
def prep_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, chunk_start_ptr, chunk_end_ptr,
                qg_ptr, kbar_ptr, w_ptr, u_ptr, p_ptr, glast_ptr, tinv_ptr, ldiag_ptr, tdiag_ptr, pdiag_ptr, scale,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                PER_CHANNEL: tl.constexpr, L2NORM: tl.constexpr, STORE_TINV: tl.constexpr,
                SPLIT_DIAG: tl.constexpr, PREC: tl.constexpr):
    """Per (chunk, head): qg = q exp(gc), kbar = k exp(gc_last - gc), w, u, P, gc_last [, Tinv], each
    stored in its buffer's dtype; SPLIT_DIAG reads the diagonal blocks diagonal.py's kernel stored."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    tok, valid = chunk_tokens(chunk_start_ptr, chunk_end_ptr, chunk, C)
    q, k, gc, beta, _, _ = chunk_inputs(q_ptr, k_ptr, g_ptr, beta_ptr, tok, valid, head, scale,
                                        H, K, PER_CHANNEL, L2NORM)
    gl = row_of(gc, C - 1, C)
    store_last(glast_ptr, gl, chunk, head, H, K, PER_CHANNEL)
    store_rows(qg_ptr, q * tl.exp(gc), tok, valid, H, K, head)
    store_rows(kbar_ptr, k * tl.exp(gl[None, :] - gc), tok, valid, H, K, head)
    tinv, p_mat = chunk_matrices(q, k, gc, beta, tok, valid, head, ldiag_ptr, tdiag_ptr, pdiag_ptr, H, C, S,
                                 PER_CHANNEL, SPLIT_DIAG, PREC)
    w = tl.dot(tinv, beta[:, None] * k * tl.exp(gc), input_precision=PREC)
    store_rows(w_ptr, w, tok, valid, H, K, head)
    v = load_rows(v_ptr, tok, valid, H, V, head)
    store_rows(u_ptr, tl.dot(tinv, beta[:, None] * v, input_precision=PREC), tok, valid, H, V, head)
    store_rows(p_ptr, p_mat, tok, valid, H, C, head)
    if STORE_TINV:
        store_rows(tinv_ptr, tinv, tok, valid, H, C, head)


@triton.jit
def load_block(ptr, tok_C, valid_C, H: tl.constexpr, D: tl.constexpr, head, col0, BD: tl.constexpr):
    """x_C,BD: columns col0 .. col0 + BD of a packed [T, H, D] tensor, in fp32."""
    cols = col0 + tl.arange(0, BD)
    offs = (tok_C.to(tl.int64) * H + head)[:, None] * D + cols[None, :]
    return tl.load(ptr + offs, mask=valid_C[:, None], other=0.0).to(tl.float32)


@triton.jit
def store_block(ptr, x, tok_C, valid_C, H: tl.constexpr, D: tl.constexpr, head, col0, BD: tl.constexpr):
    cols = col0 + tl.arange(0, BD)
    offs = (tok_C.to(tl.int64) * H + head)[:, None] * D + cols[None, :]
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=valid_C[:, None])


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
def scan_kernel(w_ptr, u_ptr, kbar_ptr, glast_ptr, h0_ptr, cu_ptr, chunk_offsets_ptr,
                h_ptr, vnew_ptr, ht_ptr,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                PER_CHANNEL: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
                PREC: tl.constexpr):
    """Per (sequence, head, V block), chunk by chunk: store the entering state h, then
    v_new = u - w h and h <- exp(gc_last) h + kbar^T v_new. State in fp32 registers."""
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
        tok = bos + c * C + tl.arange(0, C)
        valid = tok < eos
        tl.store(h_ptr + state_offsets(chunk, head, col0, H, K, V, BV), h.to(h_ptr.dtype.element_ty))
        w = load_rows(w_ptr, tok, valid, H, K, head)
        v_new = load_block(u_ptr, tok, valid, H, V, head, col0, BV) - tl.dot(w, h, input_precision=PREC)
        store_block(vnew_ptr, v_new, tok, valid, H, V, head, col0, BV)
        kbar = load_rows(kbar_ptr, tok, valid, H, K, head)
        decay = load_chunk_decay(glast_ptr, chunk, head, H, K, PER_CHANNEL)
        h = decay * h + tl.dot(tl.trans(kbar), v_new, input_precision=PREC)
    if STORE_FINAL:
        tl.store(ht_ptr + seq_offs, h)


@triton.jit
def output_kernel(qg_ptr, p_ptr, h_ptr, vnew_ptr, chunk_start_ptr, chunk_end_ptr, o_ptr,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                  PREC: tl.constexpr):
    """Per (chunk, head, V block): o = qg h + P v_new."""
    chunk, head, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tok, valid = chunk_tokens(chunk_start_ptr, chunk_end_ptr, chunk, C)
    col0 = vb * BV
    h = tl.load(h_ptr + state_offsets(chunk, head, col0, H, K, V, BV)).to(tl.float32)
    qg = load_rows(qg_ptr, tok, valid, H, K, head)
    p = load_rows(p_ptr, tok, valid, H, C, head)
    v_new = load_block(vnew_ptr, tok, valid, H, V, head, col0, BV)
    o = tl.dot(qg, h, input_precision=PREC) + tl.dot(p, v_new, input_precision=PREC)
    store_block(o_ptr, o, tok, valid, H, V, head, col0, BV)
