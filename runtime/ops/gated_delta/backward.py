"""Backward Triton kernels of the chunked gated delta rule (GDN / KDA).

From the forward's chunk tiles, Tinv, per-chunk states and v_new: `scan_bwd_kernel` (per sequence, head and
V block, chunks in reverse: dh leaving each chunk, dv_new = P^T do + kbar dh), then every chunk in parallel
`state_grad_kernel` (per chunk, head and K block: dq from do h^T and dP, dk from v_new dh^T and dP^T,
dw = -dv_new h^T, dgc and dgc_last shares) and `wy_grad_kernel` (per chunk and head: dv, dbeta, dTinv -> dL
and their share of dk and dgc; GDN's also finishes dq, dk through the l2norm and dg). KDA's per-channel
decayed Gram backward runs apart in `gram_grad_kernel` (per sub-chunk and head, off-diagonal blocks), then
diagonal.py's kernels. Partials go through HBM (dq and dk in the storage dtype, the rest fp32): cheaper than one
kernel holding them all in more registers than it has.

Chunk algebra (runtime/ops/gated_delta/torch_form.py): L = beta * gram(k, k), Tinv = (I + L)^-1, w = Tinv (beta k e^gc),
u = Tinv (beta v), v_new = u - w h, o = q e^gc h + P v_new, h_next = e^gc_last h + kbar^T v_new.

Shape legend: T packed tokens, H heads, K key dim, V value dim, C chunk size, S sub-chunk size,
BK key block, BV value block, NK = K / BK, NC chunks over all sequences, X 1 (GDN) or K (KDA).
"""
from __future__ import annotations

import triton
import triton.language as tl

from runtime.ops.gated_delta.common import decay_weighted, l2norm_bwd, mm, row_of, row_scales, store_diag
from runtime.ops.gated_delta.forward import (
    add_cols, chunk_tokens, load_chunk_log_decay, load_cols, load_row_scales, rows_at, scan_start, state_offsets,
    store_cols,
)


@triton.jit
def scan_bwd_kernel(do_ptr, p_ptr, kbar_ptr, qg_ptr, w_ptr, glast_ptr, row_scales_ptr, dht_ptr, cu_ptr,
                    chunk_offsets_ptr, dh_ptr, dvnew_ptr, dh0_ptr,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                    PER_CHANNEL: tl.constexpr, DOTS: tl.constexpr):
    """Per (sequence, head, V block), last chunk first: store dh (gradient of the state leaving the chunk),
    dv_new = P^T do + kbar dh, then dh <- e^gc_last dh + qg^T do - w^T dv_new. dh in fp32 registers; the
    products take their operands as common.mm's DOTS says ("bf16" rounds dh and dv_new as their stored
    copies are) and the tiles load in their stored dtype. dht_ptr and dh0_ptr may be None (no dht, no dh0). With
    row_scales_ptr (the scalar decay) kbar_ptr and qg_ptr hold k and q, and their factors by row (scan_kernel's)
    scale k dh and do in qg^T do."""
    head, bos, eos, first_chunk, col0, seq_offs, dh = scan_start(cu_ptr, chunk_offsets_ptr, dht_ptr, H, K, V, BV)
    num_chunks = tl.cdiv(eos - bos, C)
    if row_scales_ptr is not None:
        # a step ahead, as scan_kernel's
        k_next, q_next = load_row_scales(row_scales_ptr, bos + (num_chunks - 1) * C, bos, eos, head, H, C)
    for i in range(num_chunks):
        c = num_chunks - 1 - i
        chunk = first_chunk + c
        row0 = bos + c * C
        valid = (row0 + tl.arange(0, C) < eos)[:, None]
        if row_scales_ptr is not None:
            k_scale, q_scale = k_next, q_next
            k_next, q_next = load_row_scales(row_scales_ptr, row0 - C, bos, eos, head, H, C)
        tl.store(dh_ptr + state_offsets(chunk, head, 0, col0, H, K, V, K, BV), dh.to(dh_ptr.dtype.element_ty))
        do = tl.load(rows_at(do_ptr, row0, head, H, V, col0, C, BV), mask=valid, other=0.0)
        p = tl.load(rows_at(p_ptr, row0, head, H, C, 0, C, C), mask=valid, other=0.0)
        kbar = tl.load(rows_at(kbar_ptr, row0, head, H, K, 0, C, K), mask=valid, other=0.0)
        dv_state = mm(kbar, dh, DOTS)
        if row_scales_ptr is not None:
            dv_state *= k_scale
        dv_new = mm(tl.trans(p), do, DOTS) + dv_state
        tl.store(rows_at(dvnew_ptr, row0, head, H, V, col0, C, BV), dv_new.to(dvnew_ptr.dtype.element_ty),
                 mask=valid)
        qg = tl.load(rows_at(qg_ptr, row0, head, H, K, 0, C, K), mask=valid, other=0.0)
        w = tl.load(rows_at(w_ptr, row0, head, H, K, 0, C, K), mask=valid, other=0.0)
        gl = load_chunk_log_decay(glast_ptr, chunk, head, H, K, PER_CHANNEL)
        if row_scales_ptr is not None:
            do = do * q_scale
        dh = tl.exp(gl) * dh + mm(tl.trans(qg), do, DOTS) - mm(tl.trans(w), dv_new, DOTS)
    if dh0_ptr is not None:
        tl.store(dh0_ptr + seq_offs, dh)


@triton.jit
def load_log_decay(g_ptr, tok_C, valid_C, start, head, col0, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                   BK: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """The chunk's log decay of key columns col0 .. col0 + BK in its stored dtype: [C, BK] per channel, else [C]."""
    if PER_CHANNEL:
        g = tl.load(rows_at(g_ptr, start, head, H, K, col0, C, BK), mask=valid_C[:, None], other=0.0)
    else:
        g = tl.load(g_ptr + tok_C.to(tl.int64) * H + head, mask=valid_C, other=0.0)
    return g


@triton.jit
def in_chunk_decay(g, PER_CHANNEL: tl.constexpr):
    """In-chunk cumulative log decay of load_log_decay's g: [C, BK] per channel, else [C, 1]."""
    gc = tl.cumsum(g.to(tl.float32), 0)
    if not PER_CHANNEL:
        gc = gc[:, None]
    return gc


@triton.jit
def state_grad_kernel(q_ptr, k_ptr, g_ptr, h_ptr, dh_ptr, vnew_ptr, dvnew_ptr, do_ptr, chunk_start_ptr, chunk_end_ptr,
                      norms_ptr, dq_ptr, dk_ptr, dw_ptr, dgc_ptr, dgl_ptr, dpdiag_ptr, dpfull_ptr, gcs_ptr, scale,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, L2NORM: tl.constexpr,
                      PREC: tl.constexpr, DOTS: tl.constexpr):
    """Per (chunk and K block, head): the state-side and P-path gradients (fp32, see the module docstring).
    Stores dq (complete before l2norm), dk's and dgc's shares, dw and dgc_last; per channel also the
    diagonal blocks of dP (the K block 0 program). GDN stores dgc summed over the block's channels in
    slot kb of dgc [T, H, NK + 1] and dgc_last in slot kb of dgl [NC, H, NK].
    Per channel P's decayed Gram backward is left to gram_grad_kernel, which gets the whole masked dP as rows
    [T, H, C] (dpfull) and the in-chunk cumulative decay gc [T, H, K] (gcs), both fp32. With L2NORM q's and k's
    inverse norms come from prep's [T, H, 2] (norms_ptr)."""
    NK: tl.constexpr = K // BK
    # the K blocks of one chunk run side by side: the later ones read do, v_new and dv_new from L2
    chunk, kb, head = tl.program_id(0) // NK, tl.program_id(0) % NK, tl.program_id(1)
    start, tok, valid = chunk_tokens(chunk_start_ptr, chunk_end_ptr, chunk, C)
    col0 = kb * BK
    dqg = tl.zeros([C, BK], tl.float32)
    dkbar = tl.zeros([C, BK], tl.float32)
    dw = tl.zeros([C, BK], tl.float32)
    dp = tl.zeros([C, C], tl.float32)
    dlam = tl.zeros([BK], tl.float32)
    for vb in range(V // BV):
        offs = state_offsets(chunk, head, col0, vb * BV, H, K, V, BK, BV)
        h = tl.load(h_ptr + offs)
        dh = tl.load(dh_ptr + offs)
        do = tl.load(rows_at(do_ptr, start, head, H, V, vb * BV, C, BV), mask=valid[:, None], other=0.0)
        v_new = tl.load(rows_at(vnew_ptr, start, head, H, V, vb * BV, C, BV), mask=valid[:, None], other=0.0)
        dv_new = tl.load(rows_at(dvnew_ptr, start, head, H, V, vb * BV, C, BV), mask=valid[:, None], other=0.0)
        dqg += mm(do, tl.trans(h), DOTS)
        dkbar += mm(v_new, tl.trans(dh), DOTS)
        dw -= mm(dv_new, tl.trans(h), DOTS)
        dp += mm(do, tl.trans(v_new), DOTS)
        dlam += tl.sum(h.to(tl.float32) * dh.to(tl.float32), 1)
    # every load the tail needs is issued at once, in the stored dtype: one round of memory latency
    q_raw = tl.load(rows_at(q_ptr, start, head, H, K, col0, C, BK), mask=valid[:, None], other=0.0)
    k_raw = tl.load(rows_at(k_ptr, start, head, H, K, col0, C, BK), mask=valid[:, None], other=0.0)
    q_scale = row_scales(norms_ptr, 1, scale, tok * H + head, valid, L2NORM)
    k_scale = row_scales(norms_ptr, 0, 1.0, tok * H + head, valid, L2NORM)
    g = load_log_decay(g_ptr, tok, valid, start, head, col0, H, K, C, BK, PER_CHANNEL)
    store_cols(dw_ptr, dw, start, valid, head, col0, H, K, C, BK)
    q = q_raw.to(tl.float32) * q_scale[:, None]
    k = k_raw.to(tl.float32) * k_scale[:, None]
    gc = in_chunk_decay(g, PER_CHANNEL)
    rows = tl.arange(0, C)
    dp = tl.where(rows[:, None] >= rows[None, :], dp, 0.0)
    if PER_CHANNEL:
        if kb == 0:
            store_diag(dpdiag_ptr, dp, tok, valid, head, H, C, S)
            store_cols(dpfull_ptr, dp, start, valid, head, 0, H, C, C, C)
        store_cols(gcs_ptr, gc, start, valid, head, col0, H, K, C, BK)
    # o = qg h + P v_new with qg = q e^gc; h_next = e^gc_last h + kbar^T v_new with kbar = k e^(gc_last - gc)
    dq = dqg * tl.exp(gc)
    gl = row_of(gc, C - 1, C)
    dk = dkbar * tl.exp(gl[None, :] - gc)
    dgl = tl.sum(k * dk, 0) + tl.exp(gl) * dlam
    if not PER_CHANNEL:
        dme = decay_weighted(dp, tl.sum(gc, 1))
        dq += mm(dme, k, PREC)
        dk += mm(tl.trans(dme), q, PREC)
    dgc = q * dq - k * dk
    store_cols(dq_ptr, dq, start, valid, head, col0, H, K, C, BK)
    store_cols(dk_ptr, dk, start, valid, head, col0, H, K, C, BK)
    if PER_CHANNEL:
        store_cols(dgc_ptr, dgc, start, valid, head, col0, H, K, C, BK)
        tl.store(dgl_ptr + (chunk.to(tl.int64) * H + head) * K + col0 + tl.arange(0, BK), dgl)
    else:
        tl.store(dgc_ptr + (tok.to(tl.int64) * H + head) * (NK + 1) + kb, tl.sum(dgc, 1), mask=valid)
        tl.store(dgl_ptr + (chunk.to(tl.int64) * H + head) * NK + kb, tl.sum(dgl, 0))


@triton.jit
def wy_grad_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tinv_ptr, dvnew_ptr, dw_ptr, norms_ptr, chunk_start_ptr,
                   chunk_end_ptr, dv_ptr, dk_ptr, dgc_ptr, db_ptr, dldiag_ptr, dlfull_ptr, gcs_ptr, part_dq_ptr, dgl_ptr,
                   final_dq_ptr, final_dk_ptr, dg_ptr, scale,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, L2NORM: tl.constexpr,
                   PREC: tl.constexpr, GRAD_DOTS: tl.constexpr, SLOT: tl.constexpr):
    """Per (chunk, head): gradients through u = Tinv (beta v), w = Tinv (beta k e^gc) and Tinv = (I + L)^-1.
    The products take common.mm's GRAD_DOTS (PREC: fp32 operands; "bf16": Tinv, dw, dTinv rounded, and for
    the scalar decay dL's products on the raw k). Stores dv; adds its share to dk and dgc.
    Per channel: gc comes from state_grad_kernel's gcs [T, H, K]; stores dbeta's share before the diagonal
    blocks (fp32), the diagonal blocks of dL and dL whole (masked, rows [T, H, C] in dlfull) for gram_grad_kernel.
    Scalar decay: dL's decayed Gram backward in a second key loop, then the final dq and
    dk (final_dq, final_dk, through the l2norm), dbeta, and dg from state_grad's SLOT slots of dgc and dgl plus
    its own dgc share. dq first (its partial part_dq is complete after state_grad_kernel), dk and dg in the tail.
    With L2NORM the inverse norms come from prep's [T, H, 2] (norms_ptr)."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    NK: tl.constexpr = K // BK
    start, tok, valid = chunk_tokens(chunk_start_ptr, chunk_end_ptr, chunk, C)
    beta = tl.load(beta_ptr + tok.to(tl.int64) * H + head, mask=valid, other=0.0).to(tl.float32)
    tinv = load_cols(tinv_ptr, start, valid, head, 0, H, C, C, C)
    k_inv = row_scales(norms_ptr, 0, 1.0, tok * H + head, valid, L2NORM)
    # the scalar decay's [C, 1] gc serves every key block: loaded and summed once, off the loops' chains
    gc_rows = tl.zeros([C, 1], tl.float32)
    if not PER_CHANNEL:
        gc_rows = in_chunk_decay(load_log_decay(g_ptr, tok, valid, start, head, 0, H, K, C, 1, False), False)
        # dq reads nothing this kernel writes: first, its loads beside Tinv's instead of a round in the tail
        q_inv = row_scales(norms_ptr, 1, scale, tok * H + head, valid, L2NORM) / scale
        finish_rows(q_ptr, part_dq_ptr, final_dq_ptr, q_inv, scale, start, valid, head, H, K, C, L2NORM)
    db = tl.zeros([C], tl.float32)
    dtinv = tl.zeros([C, C], tl.float32)
    for vb in range(V // BV):
        # u = Tinv (beta v) and du = dv_new
        du = load_cols(dvnew_ptr, start, valid, head, vb * BV, H, V, C, BV)
        v = load_cols(v_ptr, start, valid, head, vb * BV, H, V, C, BV)
        dtinv += mm(du, tl.trans(beta[:, None] * v), GRAD_DOTS)
        dbv = mm(tl.trans(tinv), du, GRAD_DOTS)
        store_cols(dv_ptr, beta[:, None] * dbv, start, valid, head, vb * BV, H, V, C, BV)
        db += tl.sum(dbv * v, 1)
    for kb in range(NK):
        # the step's loads first: one round of memory latency
        k = load_cols(k_ptr, start, valid, head, kb * BK, H, K, C, BK) * k_inv[:, None]
        dw = load_cols(dw_ptr, start, valid, head, kb * BK, H, K, C, BK)
        gc = load_cols(gcs_ptr, start, valid, head, kb * BK, H, K, C, BK) if PER_CHANNEL else gc_rows
        eg = tl.exp(gc)
        kt = k * eg
        dtinv += mm(dw, tl.trans(beta[:, None] * kt), GRAD_DOTS)
        tdw = mm(tl.trans(tinv), dw, GRAD_DOTS)
        db += tl.sum(tdw * kt, 1)
        if PER_CHANNEL:
            # w = Tinv (beta k e^gc): dk += beta e^gc Tinv^T dw, dgc += k e^gc beta Tinv^T dw
            dkt = beta[:, None] * tdw
            add_cols(dk_ptr, dkt * eg, start, valid, head, kb * BK, H, K, C, BK)
            add_cols(dgc_ptr, kt * dkt, start, valid, head, kb * BK, H, K, C, BK)
    rows = tl.arange(0, C)
    # dL = -Tinv^T dTinv Tinv^T on L's strictly lower pattern
    dl = -mm(mm(tl.trans(tinv), dtinv, GRAD_DOTS), tl.trans(tinv), GRAD_DOTS)
    dl = tl.where(rows[:, None] > rows[None, :], dl, 0.0)
    if PER_CHANNEL:
        store_cols(dlfull_ptr, dl, start, valid, head, 0, H, C, C, C)
        store_diag(dldiag_ptr, dl, tok, valid, head, H, C, S)
        tl.store(db_ptr + tok.to(tl.int64) * H + head, db.to(db_ptr.dtype.element_ty), mask=valid)
    else:
        db, dgc_rows = scalar_dl_grad(k_ptr, dk_ptr, dw_ptr, dl, tinv, beta, k_inv, gc_rows, db, start, valid, head,
                                      H, K, C, BK, PREC, GRAD_DOTS)
        tl.store(db_ptr + tok.to(tl.int64) * H + head, db.to(db_ptr.dtype.element_ty), mask=valid)
        # state_grad's dg shares load during the barrier and the dk round (not held over the loops: no registers
        # left there)
        state_dgc, dgl = state_dg_shares(dgc_ptr, dgl_ptr, tok, valid, chunk, head, H, SLOT)
        # the dk partial re-read whole below was stored by the key loop's threads in other layouts
        tl.debug_barrier()
        finish_rows(k_ptr, dk_ptr, final_dk_ptr, k_inv, 1.0, start, valid, head, H, K, C, L2NORM)
        store_dg(dg_ptr, state_dgc + dgc_rows, dgl, tok, valid, head, H)


@triton.jit
def scalar_dl_grad(k_ptr, dk_ptr, dw_ptr, dl, tinv, beta, k_inv, gc, db, start, valid, head, H: tl.constexpr,
                   K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, GRAD_DOTS: tl.constexpr):
    """Scalar decay, wy_grad_kernel's second key loop: dL's decayed Gram backward and w's share (Tinv^T dw
    recomputed rather than kept over the dL products) added to dk in place; (db with its share, dgc summed over
    the channels [C])."""
    dgc_rows = tl.zeros([C], tl.float32)
    eg = tl.exp(gc)
    for kb in range(K // BK):
        k = load_cols(k_ptr, start, valid, head, kb * BK, H, K, C, BK) * k_inv[:, None]
        dkt = beta[:, None] * mm(tl.trans(tinv), load_cols(dw_ptr, start, valid, head, kb * BK, H, K, C, BK),
                                 GRAD_DOTS)
        dme = decay_weighted(dl, tl.sum(gc, 1))
        if GRAD_DOTS == PREC:
            da, dc = mm(dme, k, PREC), mm(tl.trans(dme), beta[:, None] * k, PREC)
        else:
            # the row scales go onto dL so that the products take the raw k (exact in bf16 for bf16 inputs) and
            # only the scaled dL is rounded
            k_raw = tl.load(rows_at(k_ptr, start, head, H, K, kb * BK, C, BK), mask=valid[:, None], other=0.0)
            da = mm(dme * k_inv[None, :], k_raw, GRAD_DOTS)
            dc = mm(tl.trans(dme * (beta * k_inv)[:, None]), k_raw, GRAD_DOTS)
        db += tl.sum(da * k, 1)
        dk = beta[:, None] * da + dc + dkt * eg
        dgc = k * (beta[:, None] * da - dc + eg * dkt)
        dk += load_cols(dk_ptr, start, valid, head, kb * BK, H, K, C, BK)
        store_cols(dk_ptr, dk, start, valid, head, kb * BK, H, K, C, BK)
        dgc_rows += tl.sum(dgc, 1)
    return db, dgc_rows


@triton.jit
def sub_chunk_rows(ptr, norms_ptr, slot: tl.constexpr, scale, start, valid_S, head, H: tl.constexpr, K: tl.constexpr,
                   S: tl.constexpr, L2NORM: tl.constexpr):
    """x_SK in fp32, l2-normalized over K (with L2NORM: prep's stored inverse norms, see row_scales) and times
    scale: the S rows of a sub-chunk of a packed [T, H, K] tensor."""
    f_S = row_scales(norms_ptr, slot, scale, (start + tl.arange(0, S)) * H + head, valid_S, L2NORM)
    return load_cols(ptr, start, valid_S, head, 0, H, K, S, K) * f_S[:, None]


@triton.jit
def gram_grad_kernel(q_ptr, k_ptr, beta_ptr, gcs_ptr, dl_ptr, dp_ptr, norms_ptr, chunk_start_ptr, chunk_end_ptr,
                     part_dq_ptr, part_dk_ptr, part_dgc_ptr, part_db_ptr, scale,
                     H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, S: tl.constexpr, L2NORM: tl.constexpr,
                     PREC: tl.constexpr):
    """Per (sub-chunk b of a chunk, head), per-channel decay: the share of the
    off-diagonal S x S blocks of L = beta gram(k, k) and P = gram(q, k) in the gradients of sub-chunk b's rows,
    added in place to the partial dq, dk, dgc [T, H, K] and dbeta [T, H] (each program owns its rows; the
    diagonal blocks stay with diagonal.py). dL and dP come whole as rows [T, H, C] (masked to their
    patterns), gc as [T, H, K]: all fp32.
    As a row (a = beta k or q): da_i = e^(gc_i - r) sum_{j < bS} dM_ij k_j e^(r - gc_j), r the gc of row bS;
    as a column: dc_j = sum over later sub-chunks c (reference r_c, the gc of row cS) of
    e^(r_c - gc_j) sum_i dM_ij a_i e^(gc_i - r_c). Every exponent is <= 0, so no factor overflows for any
    decay; [S, S] x [S, K] products (common.mm's PREC: bf16 operands for bf16 inputs) over whole-K tiles loaded
    from L2. With L2NORM q's and k's inverse norms come from prep's [T, H, 2] (norms_ptr)."""
    NS: tl.constexpr = C // S
    chunk, b, head = tl.program_id(0) // NS, tl.program_id(0) % NS, tl.program_id(1)
    chunk_start, chunk_end = tl.load(chunk_start_ptr + chunk), tl.load(chunk_end_ptr + chunk)
    start = chunk_start + b * S
    if start < chunk_end:
        valid = start + tl.arange(0, S) < chunk_end
        k = sub_chunk_rows(k_ptr, norms_ptr, 0, 1.0, start, valid, head, H, K, S, L2NORM)
        q = sub_chunk_rows(q_ptr, norms_ptr, 1, scale, start, valid, head, H, K, S, L2NORM)
        beta = tl.load(beta_ptr + (start + tl.arange(0, S)).to(tl.int64) * H + head, mask=valid,
                       other=0.0).to(tl.float32)
        gc = load_cols(gcs_ptr, start, valid, head, 0, H, K, S, K)
        da_l, da_p = gram_rows_grad(k_ptr, gcs_ptr, dl_ptr, dp_ptr, norms_ptr, chunk_start, start, valid, gc, head, b,
                                    H, K, C, S, L2NORM, PREC)
        dc = gram_cols_grad(q_ptr, k_ptr, beta_ptr, gcs_ptr, dl_ptr, dp_ptr, norms_ptr, chunk_start, chunk_end, gc,
                            head, b, scale, H, K, C, S, L2NORM, PREC)
        add_cols(part_dq_ptr, da_p, start, valid, head, 0, H, K, S, K)
        add_cols(part_dk_ptr, beta[:, None] * da_l + dc, start, valid, head, 0, H, K, S, K)
        add_cols(part_dgc_ptr, k * (beta[:, None] * da_l - dc) + q * da_p, start, valid, head, 0, H, K, S, K)
        db_offs = (start + tl.arange(0, S)).to(tl.int64) * H + head
        db = tl.load(part_db_ptr + db_offs, mask=valid, other=0.0) + tl.sum(da_l * k, 1)
        tl.store(part_db_ptr + db_offs, db, mask=valid)


@triton.jit
def gram_rows_grad(k_ptr, gcs_ptr, dl_ptr, dp_ptr, norms_ptr, chunk_start, start, valid_S, gc_SK, head, b,
                   H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, S: tl.constexpr, L2NORM: tl.constexpr,
                   PREC: tl.constexpr):
    """(da of L, da of P) of sub-chunk b's rows against the earlier sub-chunks (see gram_grad_kernel)."""
    ref_K = tl.load(gcs_ptr + (start.to(tl.int64) * H + head) * K + tl.arange(0, K))
    acc_l = tl.zeros([S, K], tl.float32)
    acc_p = tl.zeros([S, K], tl.float32)
    every = tl.full([S], 1, tl.int1)
    for jb in range(b):
        row0 = chunk_start + jb * S
        k_j = sub_chunk_rows(k_ptr, norms_ptr, 0, 1.0, row0, every, head, H, K, S, L2NORM)
        kc = k_j * tl.exp(ref_K[None, :] - load_cols(gcs_ptr, row0, every, head, 0, H, K, S, K))
        acc_l += mm(load_cols(dl_ptr, start, valid_S, head, jb * S, H, C, S, S), kc, PREC)
        acc_p += mm(load_cols(dp_ptr, start, valid_S, head, jb * S, H, C, S, S), kc, PREC)
    # rows past the chunk's end read gc 0: their factor is held at 0 instead of e^-ref
    fa = tl.where(valid_S[:, None], tl.exp(gc_SK - ref_K[None, :]), 0.0)
    return acc_l * fa, acc_p * fa


@triton.jit
def gram_cols_grad(q_ptr, k_ptr, beta_ptr, gcs_ptr, dl_ptr, dp_ptr, norms_ptr, chunk_start, chunk_end,
                   gc_SK, head, b, scale, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                   L2NORM: tl.constexpr, PREC: tl.constexpr):
    """dc (both matrices' share of dk as the column key) of sub-chunk b's rows against the later sub-chunks."""
    dc = tl.zeros([S, K], tl.float32)
    for ib in range(b + 1, tl.cdiv(chunk_end - chunk_start, S)):
        row0 = chunk_start + ib * S
        valid_i = row0 + tl.arange(0, S) < chunk_end
        ref_K = tl.load(gcs_ptr + (row0.to(tl.int64) * H + head) * K + tl.arange(0, K))
        fa = tl.where(valid_i[:, None],
                      tl.exp(load_cols(gcs_ptr, row0, valid_i, head, 0, H, K, S, K) - ref_K[None, :]), 0.0)
        k_i = sub_chunk_rows(k_ptr, norms_ptr, 0, 1.0, row0, valid_i, head, H, K, S, L2NORM)
        q_i = sub_chunk_rows(q_ptr, norms_ptr, 1, scale, row0, valid_i, head, H, K, S, L2NORM)
        beta_i = tl.load(beta_ptr + (row0 + tl.arange(0, S)).to(tl.int64) * H + head, mask=valid_i, other=0.0)
        dl_t = tl.trans(load_cols(dl_ptr, row0, valid_i, head, b * S, H, C, S, S))
        dp_t = tl.trans(load_cols(dp_ptr, row0, valid_i, head, b * S, H, C, S, S))
        part = mm(dl_t, beta_i.to(tl.float32)[:, None] * k_i * fa, PREC)
        part += mm(dp_t, q_i * fa, PREC)
        dc += part * tl.exp(ref_K[None, :] - gc_SK)
    return dc


@triton.jit
def finish_rows(x_ptr, part_ptr, out_ptr, inv_C, dy_scale, start, valid_C, head, H: tl.constexpr, K: tl.constexpr,
                C: tl.constexpr, L2NORM: tl.constexpr):
    """Stores dx (out_ptr's dtype) of the chunk's whole rows through the l2norm (rows' inverse norms inv_C), from
    the complete partial gradient part * dy_scale of the normalized rows."""
    dx = load_cols(part_ptr, start, valid_C, head, 0, H, K, C, K) * dy_scale
    if L2NORM:
        dx = l2norm_bwd(load_cols(x_ptr, start, valid_C, head, 0, H, K, C, K) * inv_C[:, None], inv_C, dx, True)
    store_cols(out_ptr, dx, start, valid_C, head, 0, H, K, C, K)


@triton.jit
def state_dg_shares(dgc_ptr, dgl_ptr, tok_C, valid_C, chunk, head, H: tl.constexpr, NK: tl.constexpr):
    """Scalar decay: (dgc_C summed over state_grad_kernel's NK slots of dgc [T, H, NK + 1], dgc_last summed over the
    NK slots of dgl [NC, H, NK])."""
    row_offs = (tok_C.to(tl.int64) * H + head) * (NK + 1)
    dgc = tl.zeros([tok_C.shape[0]], tl.float32)
    dgl = 0.0
    for slot in tl.static_range(NK):
        dgc += tl.load(dgc_ptr + row_offs + slot, mask=valid_C, other=0.0)
        dgl += tl.load(dgl_ptr + (chunk.to(tl.int64) * H + head) * NK + slot)
    return dgc, dgl


@triton.jit
def store_dg(dg_ptr, dgc_C, dgl, tok_C, valid_C, head, H: tl.constexpr):
    """Scalar decay: dg = dgc_last + the reverse cumsum of dgc over the chunk."""
    dg = dgl + tl.sum(dgc_C, 0) - tl.cumsum(dgc_C, 0) + dgc_C
    tl.store(dg_ptr + tok_C.to(tl.int64) * H + head, dg.to(dg_ptr.dtype.element_ty), mask=valid_C)
