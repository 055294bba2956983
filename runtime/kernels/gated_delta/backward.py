"""Backward Triton kernels of the chunked gated delta rule (GDN / KDA).

The backward recomputes the forward's chunk-local quantities (prep_kernel with Tinv, scan_kernel for
the chunk states) instead of keeping them from the forward (the keep_forward variant keeps them), then
runs two launches:
`scan_bwd_kernel` (per sequence, head and V block, chunks in reverse: the state gradient dh entering
each chunk from its end, and dv_new = P^T do + kbar dh) and `grad_kernel` (every chunk in parallel:
all input gradients, through the UT inverse, the decayed Gram matrices, the decay cumsum and l2norm;
in the split-diagonal variant for KDA, diagonal.py's `diag_grad_kernel` adds the diagonal blocks'
share and finishes the cumsum and l2norm).

Chunk algebra (runtime/ops/gated_delta.py): L = beta * gram(k, k), Tinv = (I + L)^-1,
w = Tinv (beta k e^gc), u = Tinv (beta v), v_new = u - w h, o = q e^gc h + P v_new,
h_next = e^gc_last h + kbar^T v_new, kbar = k e^(gc_last - gc).

Shape legend: T packed tokens, H heads, K key dim, V value dim, C chunk size, S sub-chunk size,
BV value block, X 1 (GDN) or K (KDA).
"""
from __future__ import annotations

import triton
import triton.language as tl

from runtime.kernels.gated_delta.common import decayed_gram_bwd, row_of, store_diag
from runtime.kernels.gated_delta.forward import (
    chunk_inputs, chunk_tokens, load_block, load_chunk_decay, load_rows, state_offsets, store_block, store_last,
    store_rows,
)


@triton.jit
def scan_bwd_kernel(do_ptr, p_ptr, kbar_ptr, qg_ptr, w_ptr, glast_ptr, dht_ptr, cu_ptr, chunk_offsets_ptr,
                    dh_ptr, dvnew_ptr, dh0_ptr,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                    PER_CHANNEL: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                    PREC: tl.constexpr):
    """Per (sequence, head, V block), last chunk first: store dh (gradient of the state leaving the chunk),
    dv_new = P^T do + kbar dh, then dh <- e^gc_last dh + qg^T do - w^T dv_new."""
    seq, head, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = tl.load(cu_ptr + seq), tl.load(cu_ptr + seq + 1)
    first_chunk = tl.load(chunk_offsets_ptr + seq)
    num_chunks = tl.cdiv(eos - bos, C)
    col0 = vb * BV
    seq_offs = state_offsets(seq, head, col0, H, K, V, BV)
    dh = tl.zeros([K, BV], tl.float32)
    if HAS_DHT:
        dh += tl.load(dht_ptr + seq_offs)
    for i in range(num_chunks):
        c = num_chunks - 1 - i
        chunk = first_chunk + c
        tok = bos + c * C + tl.arange(0, C)
        valid = tok < eos
        tl.store(dh_ptr + state_offsets(chunk, head, col0, H, K, V, BV), dh.to(dh_ptr.dtype.element_ty))
        do = load_block(do_ptr, tok, valid, H, V, head, col0, BV)
        p = load_rows(p_ptr, tok, valid, H, C, head)
        kbar = load_rows(kbar_ptr, tok, valid, H, K, head)
        dv_new = tl.dot(tl.trans(p), do, input_precision=PREC) + tl.dot(kbar, dh, input_precision=PREC)
        store_block(dvnew_ptr, dv_new, tok, valid, H, V, head, col0, BV)
        qg = load_rows(qg_ptr, tok, valid, H, K, head)
        w = load_rows(w_ptr, tok, valid, H, K, head)
        decay = load_chunk_decay(glast_ptr, chunk, head, H, K, PER_CHANNEL)
        dh = decay * dh + tl.dot(tl.trans(qg), do, input_precision=PREC) - tl.dot(tl.trans(w), dv_new, input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0_ptr + seq_offs, dh)


@triton.jit
def value_side_grads(v_ptr, do_ptr, vnew_ptr, dvnew_ptr, h_ptr, dh_ptr, dv_ptr, tinv, beta, tok, valid, chunk, head,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                     PREC: tl.constexpr):
    """Loops over V blocks: stores dv; returns (dqg, dkbar, dw, dP, dTinv, dbeta part, sum_v h dh)."""
    dqg = tl.zeros([C, K], tl.float32)
    dkbar = tl.zeros([C, K], tl.float32)
    dw = tl.zeros([C, K], tl.float32)
    dp = tl.zeros([C, C], tl.float32)
    dtinv = tl.zeros([C, C], tl.float32)
    db = tl.zeros([C], tl.float32)
    dlam = tl.zeros([K], tl.float32)
    for vb in range(V // BV):
        col0 = vb * BV
        h = tl.load(h_ptr + state_offsets(chunk, head, col0, H, K, V, BV)).to(tl.float32)
        dh = tl.load(dh_ptr + state_offsets(chunk, head, col0, H, K, V, BV)).to(tl.float32)
        do = load_block(do_ptr, tok, valid, H, V, head, col0, BV)
        v_new = load_block(vnew_ptr, tok, valid, H, V, head, col0, BV)
        dv_new = load_block(dvnew_ptr, tok, valid, H, V, head, col0, BV)
        dqg += tl.dot(do, tl.trans(h), input_precision=PREC)
        dkbar += tl.dot(v_new, tl.trans(dh), input_precision=PREC)
        dw -= tl.dot(dv_new, tl.trans(h), input_precision=PREC)
        dp += tl.dot(do, tl.trans(v_new), input_precision=PREC)
        dlam += tl.sum(h * dh, 1)
        # u = Tinv (beta v) and du = dv_new
        dbv = tl.dot(tl.trans(tinv), dv_new, input_precision=PREC)
        v = load_block(v_ptr, tok, valid, H, V, head, col0, BV)
        store_block(dv_ptr, beta[:, None] * dbv, tok, valid, H, V, head, col0, BV)
        db += tl.sum(dbv * v, 1)
        dtinv += tl.dot(dv_new, tl.trans(beta[:, None] * v), input_precision=PREC)
    return dqg, dkbar, dw, dp, dtinv, db, dlam


@triton.jit
def grad_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tinv_ptr, h_ptr, dh_ptr, vnew_ptr, dvnew_ptr, do_ptr,
                chunk_start_ptr, chunk_end_ptr, dq_ptr, dk_ptr, dv_ptr, dg_ptr, dbeta_ptr,
                dldiag_ptr, dpdiag_ptr, part_dq_ptr, part_dk_ptr, part_dgc_ptr, part_db_ptr, dgl_ptr, scale,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                BV: tl.constexpr, PER_CHANNEL: tl.constexpr, L2NORM: tl.constexpr, SPLIT_DIAG: tl.constexpr,
                PREC: tl.constexpr):
    """Per (chunk, head): dq, dk, dv, dg, dbeta of the chunk. With SPLIT_DIAG (per channel only) it
    stores dv, the diagonal blocks of dL and dP and the fp32 partials (dq, dk, dgc, dbeta before the
    diagonal blocks' share, dgc_last) for diagonal.diag_grad_kernel to finish."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    tok, valid = chunk_tokens(chunk_start_ptr, chunk_end_ptr, chunk, C)
    q, k, gc, beta, q_inv, k_inv = chunk_inputs(q_ptr, k_ptr, g_ptr, beta_ptr, tok, valid, head, scale,
                                                H, K, PER_CHANNEL, L2NORM)
    tinv = load_rows(tinv_ptr, tok, valid, H, C, head)
    dqg, dkbar, dw, dp, dtinv, db, dlam = value_side_grads(
        v_ptr, do_ptr, vnew_ptr, dvnew_ptr, h_ptr, dh_ptr, dv_ptr, tinv, beta, tok, valid, chunk, head,
        H, K, V, C, BV, PREC)
    rows = tl.arange(0, C)
    eg = tl.exp(gc)
    # w = Tinv (beta k e^gc)
    kt = k * eg
    dtinv += tl.dot(dw, tl.trans(beta[:, None] * kt), input_precision=PREC)
    dbk = tl.dot(tl.trans(tinv), dw, input_precision=PREC)
    db += tl.sum(dbk * kt, 1)
    dkt = beta[:, None] * dbk
    # Tinv = (I + L)^-1: dL = -Tinv^T dTinv Tinv^T on L's strictly lower pattern
    dl = -tl.dot(tl.dot(tl.trans(tinv), dtinv, input_precision=PREC), tl.trans(tinv), input_precision=PREC)
    dl = tl.where(rows[:, None] > rows[None, :], dl, 0.0)
    da, dc = decayed_gram_bwd(dl, beta[:, None] * k, k, gc, PER_CHANNEL, C, S, PREC, not SPLIT_DIAG)
    db += tl.sum(da * k, 1)
    dk = beta[:, None] * da + dc
    dgc = beta[:, None] * k * da - k * dc
    dp = tl.where(rows[:, None] >= rows[None, :], dp, 0.0)
    da, dc = decayed_gram_bwd(dp, q, k, gc, PER_CHANNEL, C, S, PREC, not SPLIT_DIAG)
    dq = da + dqg * eg
    dk += dc + dkt * eg
    dgc += q * da - k * dc + q * eg * dqg + kt * dkt
    gl = row_of(gc, C - 1, C)
    ebar = tl.exp(gl[None, :] - gc)
    dk += dkbar * ebar
    dgc -= k * ebar * dkbar
    dgl = tl.sum(k * ebar * dkbar, 0) + tl.exp(gl) * dlam
    if SPLIT_DIAG:
        store_diag(dldiag_ptr, dl, tok, valid, head, H, C, S)
        store_diag(dpdiag_ptr, dp, tok, valid, head, H, C, S)
        store_partials(part_dq_ptr, part_dk_ptr, part_dgc_ptr, part_db_ptr, dgl_ptr, dq, dk, dgc, db, dgl,
                       tok, valid, chunk, head, H, K)
    else:
        store_dg(dg_ptr, dgc, dgl, tok, valid, head, H, K, C, PER_CHANNEL)
        tl.store(dbeta_ptr + tok.to(tl.int64) * H + head, db.to(dbeta_ptr.dtype.element_ty), mask=valid)
        store_rows(dq_ptr, l2norm_bwd(q / scale, q_inv, dq * scale, L2NORM), tok, valid, H, K, head)
        store_rows(dk_ptr, l2norm_bwd(k, k_inv, dk, L2NORM), tok, valid, H, K, head)


@triton.jit
def store_partials(part_dq_ptr, part_dk_ptr, part_dgc_ptr, part_db_ptr, dgl_ptr, dq, dk, dgc, db, dgl,
                   tok, valid, chunk, head, H: tl.constexpr, K: tl.constexpr):
    """fp32 gradients of the scaled normalized q and k, of gc and beta, and of gc_last [NC, H, K]."""
    store_rows(part_dq_ptr, dq, tok, valid, H, K, head)
    store_rows(part_dk_ptr, dk, tok, valid, H, K, head)
    store_rows(part_dgc_ptr, dgc, tok, valid, H, K, head)
    tl.store(part_db_ptr + tok.to(tl.int64) * H + head, db, mask=valid)
    store_last(dgl_ptr, dgl, chunk, head, H, K, True)


@triton.jit
def l2norm_bwd(y, inv, dy, USE: tl.constexpr):
    """dx of y = x * inv with inv = (sum x^2 + eps)^-1/2: inv (dy - y (y . dy))."""
    if USE:
        dx = inv[:, None] * (dy - y * tl.sum(y * dy, 1)[:, None])
    else:
        dx = dy
    return dx


@triton.jit
def store_dg(dg_ptr, dgc, dgl, tok, valid, head, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
             PER_CHANNEL: tl.constexpr):
    """dg from dgc (gradient of the in-chunk cumsum) plus dgl on the last row: a reverse cumsum."""
    rows = tl.arange(0, C)
    if PER_CHANNEL:
        dgc += tl.where(rows[:, None] == C - 1, dgl[None, :], 0.0)
        dg = tl.sum(dgc, 0)[None, :] - tl.cumsum(dgc, 0) + dgc
        store_rows(dg_ptr, dg, tok, valid, H, K, head)
    else:
        dgc_C = tl.sum(dgc, 1) + tl.where(rows == C - 1, tl.sum(dgl, 0), 0.0)
        dg = tl.sum(dgc_C, 0) - tl.cumsum(dgc_C, 0) + dgc_C
        tl.store(dg_ptr + tok.to(tl.int64) * H + head, dg.to(dg_ptr.dtype.element_ty), mask=valid)
