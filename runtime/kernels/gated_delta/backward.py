"""Backward Triton kernels of the chunked gated delta rule (GDN / KDA).

The backward takes the forward's chunk-local quantities (prep_kernel's tiles with Tinv, scan_kernel's
states and v_new: kept from the forward, or recomputed when keep_forward is off), then runs:
`scan_bwd_kernel` (per sequence, head and V block, chunks in reverse: the state gradient dh leaving
each chunk, and dv_new = P^T do + kbar dh), then every chunk in parallel:
`state_grad_kernel` (per chunk, head and K block: the state-side and P-path gradients, dq from
  do h^T and dP, dk from v_new dh^T and dP^T, dw = -dv_new h^T, dgc and dgc_last shares; the K blocks
  keep the fp32 accumulators at [C, BK]),
`wy_grad_kernel` (per chunk and head: dv, dbeta, dTinv -> dL, and their share of dk and dgc through
  w, Tinv and the decayed Gram of k),
and to finish `finish_kernel` (scalar decay: l2norm backward of q and k, dg as a reverse cumsum) or, per
channel, diagonal.py's `diag_grad_kernel` (the diagonal blocks' share, then the same finish).
KernelVariant.fused_finish (scalar decay) moves finish_kernel's work into wy_grad_kernel; with stored_norms the
kernels read the inverse norms of q and k prep stored instead of recomputing them.
Intermediates between the three go through HBM in fp32 ([T, H, K]: 134 MB, 32 us each way at the
benchmark shape), cheaper than the register spills of one kernel holding them all (the kernel these
replace, one program per chunk and head with three [C, K] fp32 accumulators: 255 registers, 3.6 KB of
spills, 200 KB of shared memory, 2.30 ms GDN / 22.6 ms KDA on the H200).

Measured on the H200 (2026-11-29 11:28, B1 T8192 H32 K=V=128 bf16; GDN / KDA ms): scan_bwd 0.35 / 0.36,
state_grad 0.88 / 1.66, wy_grad 0.88 / 1.97, finish 0.14 (GDN). Round 1 predicted state_grad 0.35 and
wy_grad 0.30 from bytes alone (~1 GB, 0.25 ms at 4.24 TB/s): both run one 8-warp program per SM (227-255
registers) through 31-62 waves, so each program's serial chain is exposed: 14 us per state_grad program,
28 us per wy_grad program (about ten dependent load rounds plus ~15 small products, tf32 on fp32 operands
staged through up to 80 KB of shared memory). state_grad got faster with a smaller key block (0.75 at 32)
despite reading do, v_new and dv_new twice as often, so its time follows the per-program chain, not bytes.
Predictions for the next run (GDN state_grad / wy_grad ms; the default's wy_grad loads and sums the
scalar gc once instead of in each of its four key steps, 244 -> 227 registers: ~0.83):
  SETTINGS "state_key_block_32"  0.75 / ~0.83 (state_grad measured at 0.748 and 0.756 with key block 32;
                                 wy_grad keeps 64; KDA keeps 64 for both: unchanged).
  SETTINGS "state_kb32_wy_r128"  0.75 / ~0.70-0.85: wy_grad capped at 128 registers (512 B of spills to L1)
                                 fits two programs per SM, one's loads under the other's products (uncertain:
                                 the cap gained nothing for state_grad at key block 32, 0.756 vs 0.748).
  SETTINGS "wy_r128"             0.88 / as above.
  SETTINGS "state_key_block_16"  ~0.70-0.85 / ~0.83: 32768 programs, 214 registers, no spill; do, v_new and
                                 dv_new read 8 times (1.6 GB from L2).
  SETTINGS "r128"                ~0.9 (1.2 KB of spills at key block 64) / as wy_r128.
  VARIANT "bf16_grads"           0.88 / ~0.65-0.75 (KDA ~1.6-1.8): wy_grad's products on bf16 operands, 32 KB of
                                 shared memory instead of 80 and half the wgmma instructions (tf32 takes k=8
                                 per instruction, bf16 k=16), a transposed Tinv operand native in bf16; dw's
                                 scratch bf16 (67 MB less written, 134 MB less read: ~50 us over both kernels).

KDA (per-channel decay) with KernelVariant.gram_grad_apart: why KDA's wy_grad took 1.94 ms against GDN's 0.49
(and state_grad 1.65 against 0.81): the per-channel decayed Gram backward (common.decayed_gram_bwd) runs inside
both, per key block three rounds of a row_of reduction (cross-warp), two [C, BK] exps and two [C, C] x [C, BK]
tf32 products on fp32 operands staged through shared memory (12 such products per wy_grad program, 6 per
state_grad program, 16 times the useful work: only the blocks below the diagonal count), with a cumsum per
key block, and that leaves ptxas at 255 registers with 560 B (wy_grad) / 568 B (state_grad) of spills. With
the flag, state_grad and wy_grad store dP and dL whole ([T, H, C] fp32) and gc ([T, H, K] fp32, from
state_grad's cumsum) and do no Gram backward; `gram_grad_kernel` (per sub-chunk and head, [S, K] tiles read
from L2) does the off-diagonal blocks of both matrices with [S, S] x [S, K] products against the earlier
(rows) and later (columns) sub-chunks, with the same sub-chunk reference rows as before (every exponent <= 0,
tf32 as before: the same numerics), and adds its share to the partial dq, dk, dgc, dbeta in place. wy_grad
then runs one key loop (w's share of dk and dgc beside dTinv's products, Tinv^T dw formed once).
ptxas (sm_90a, H32 K=V=128, bf16 tiles; registers / spills / shared memory), before -> with the flag:
  state_grad (8 warps, key block 64)  255 / 568 B / 40 KB -> 255 / 48 B / 40 KB (key block 32: 240 / 0 / 32 KB;
                                      without the flag now 255 / 496 B: the Gram backward added after dgl, same sums)
  wy_grad (8 warps) tf32              255 / 560 B / 80 KB -> 228 / 0 / 80 KB
  wy_grad (8 warps) bf16_grad_dots    255 / 584 B / 32 KB -> 244 / 0 / 16 KB
  gram_grad (new)                     4 warps 255 / 32 B / 9 KB (two programs per SM); 8 warps 179 / 0 / 9 KB
Predictions at B1 T8192 H32 K=V=128 bf16 (ms; measured before: wy_grad 1.94, state_grad 1.65):
  "kda_gram_apart"            wy_grad 0.75-0.9 (GDN's tf32 wy_grad measured 0.81-0.88 with its Gram backward and
                              a second key loop; here the dk / dgc read-modify-writes instead), state_grad 0.9-1.0
                              (GDN's 0.81 plus the gc and dP stores, 200 MB: ~50 us), gram_grad 0.3-0.45 (16384
                              programs, ~1.2 GB from HBM: the dq, dk, dgc partials read and written 0.8 GB, gc,
                              dL, dP, q, k 0.4 GB, at ~4 TB/s 0.3 ms; <= 3 dependent load-product rounds each).
                              Gradient kernels 3.59 -> ~2.0-2.3: KDA fwd+bwd 7.57 -> ~6.0-6.3.
  "kda_gram_apart_bf16"       wy_grad 0.45-0.6 (GDN's bf16 wy_grad 0.49; dw's scratch bf16 also halves its
                              write in state_grad), the rest as above: fwd+bwd ~5.7-6.0.
  "kda_gram_apart_bf16_w8"    gram_grad at 8 warps (one program per SM, no spill): 0.3-0.5, uncertain which wins.
  "kda_gram_apart_bf16_skb32" state_grad in key blocks of 32 (240 registers, no spill; GDN went 0.88 -> 0.75 at
                              32): state_grad ~0.8-0.9.
Measured (H200, 13:40, bench/results/2026-11-29-kda-gram-apart.json; fwd+bwd against 7.47 for the settings
before): kda_gram_apart 6.53 (wy_grad 0.72, state_grad 0.93, gram_grad 0.78: the gram_grad prediction missed by
~2x, as bytes-only predictions did before), _bf16 6.23 (wy_grad 0.58), _bf16_w8 6.51 (gram_grad 1.10 at 8
warps), _bf16_skb32 6.20 (state_grad 0.80). gram_grad_apart with bf16 wy_grad products and key block 32 is part
of the per-channel default since (function.PER_CHANNEL_DECAY_DEFAULT).

Chunk algebra (runtime/ops/gated_delta.py): L = beta * gram(k, k), Tinv = (I + L)^-1,
w = Tinv (beta k e^gc), u = Tinv (beta v), v_new = u - w h, o = q e^gc h + P v_new,
h_next = e^gc_last h + kbar^T v_new, kbar = k e^(gc_last - gc).

Shape legend: T packed tokens, H heads, K key dim, V value dim, C chunk size, S sub-chunk size,
BK key block, BV value block, NK = K / BK, NC chunks over all sequences, X 1 (GDN) or K (KDA).
"""
from __future__ import annotations

import triton
import triton.language as tl

from runtime.kernels.gated_delta.common import decayed_gram_bwd, l2norm_rows, mm, row_of, scalar_gram_bwd, store_diag
from runtime.kernels.gated_delta.forward import chunk_tokens, load_chunk_decay, rows_at, state_offsets

# Launch settings of the gradient kernels (timed on the H200 as SETTINGS below; ptxas for sm_90a at H32 K=V=128,
# bf16 tiles: registers / spill bytes). Key block of state_grad_kernel and wy_grad_kernel: 64 keeps
# state_grad's four fp32 accumulators at [C, 64] (GDN 8 warps 255 / 72 B, KDA 255 / 544 B; 4 warps
# spill 2.1-2.6 KB); 32 gets GDN to 187 / 0 at 8 warps but reads do, v_new, dv_new and recomputes dP 4 times.
KEY_BLOCK = 64
# key block of state_grad_kernel alone, scalar decay only (None: KEY_BLOCK). Measured 11:28 with KEY_BLOCK
# 32 for both: GDN state_grad 0.75 against 0.88 ms at 64 (dP recomputed, do, v_new and dv_new read 4 times,
# still faster; 183 registers, no spill), wy_grad 1.09 against 0.88 (4 sequential key steps in each of its
# two loops); KDA state_grad 1.78 against 1.66, so per channel it keeps KEY_BLOCK
STATE_KEY_BLOCK = None
# 4 warps since 16:52 (H200, bench/results/2026-11-29-grad-warps-1652.json): with the pointers 16-byte aligned as
# launched ptxas gives 171 registers / 0 B at key block 32 against 103 at 8 warps. ncu (16:35) had seen two 8-warp
# programs per SM with L1/TEX at 77% of its throughput; predicted no faster, measured state_grad 0.70 -> 0.55 ms
STATE_GRAD_WARPS = 4
STATE_GRAD_STAGES = 1
# register cap (ptxas maxnreg, None: up to 255): 128 at 8 warps lets two programs share an SM (GDN at key
# block 32: 64 B of spills; at 64: 1.4 KB)
STATE_GRAD_MAXNREG = None
# wy_grad_kernel: 4 warps since 16:52 (same run): ptxas with aligned pointers, GDN defaults (stored norms, fused
# finish) 255 registers / 32 B of spills against 223 / 0 at 8 warps, KDA 255 / 112 B against 209 / 0; two programs
# per SM instead of one (ncu at 16:35: one, no eligible warp 77% of cycles). GDN wy_grad 0.65 -> 0.46 ms (predicted
# 0.50-0.60). Both at 4 warps: GDN fwd+bwd 2.43 / 2.40 against 2.69 / 2.66 ms at 8 (two rounds), KDA 4.82 / 4.78
# against 5.02 / 5.07; the fp64 precision check at the benchmark shape passes for both kinds as before
WY_GRAD_WARPS = 4
WY_GRAD_STAGES = 1
# register cap of wy_grad_kernel (as STATE_GRAD_MAXNREG): 128 at 8 warps, two programs per SM, spills 512 B
# (GDN; with KernelVariant.bf16_grad_dots 596 B)
WY_GRAD_MAXNREG = None
# finish_kernel: [C, K] tiles, 237 / 0 B at 8 warps (4 warps: 472 B)
FINISH_WARPS = 8
# Alternatives to time, as changes from the constants above (use_settings(name) before a run), most
# promising first; predictions (GDN state_grad / wy_grad ms, default 0.88 / ~0.83) in the module docstring.
# Dropped after the 11:28 run: KEY_BLOCK 32 for both kernels (fwd+bwd 4.21 ms, with state_grad's register cap
# 128: 4.07, against 3.82); state_grad with 2 stages (ptxas: the same 64 KB of shared memory, nothing
# pipelined) and 4 warps (1.9 KB of spills)
SETTINGS: dict[str, dict] = {
    "default": {},
    "state_key_block_32": dict(STATE_KEY_BLOCK=32),
    "state_kb32_wy_r128": dict(STATE_KEY_BLOCK=32, WY_GRAD_MAXNREG=128),
    "wy_r128": dict(WY_GRAD_MAXNREG=128),
    "state_key_block_16": dict(STATE_KEY_BLOCK=16),
    "r128": dict(STATE_GRAD_MAXNREG=128, WY_GRAD_MAXNREG=128),
    # the 8-warp state_grad and wy_grad of the defaults before 16:52 (the launch constants' comments), together and
    # one at a time (16:52: 2.81, wy_grad alone at 4 warps 2.55, state_grad alone 2.61 ms in the same pass)
    "w8": dict(STATE_GRAD_WARPS=8, WY_GRAD_WARPS=8),
    "wy_w8": dict(WY_GRAD_WARPS=8),
    "state_w8": dict(STATE_GRAD_WARPS=8),
}
_DEFAULT_SETTINGS = {name: globals()[name] for name in (
    "KEY_BLOCK", "STATE_KEY_BLOCK", "STATE_GRAD_WARPS", "STATE_GRAD_STAGES", "STATE_GRAD_MAXNREG", "WY_GRAD_WARPS",
    "WY_GRAD_STAGES", "WY_GRAD_MAXNREG", "FINISH_WARPS")}


def use_settings(name: str) -> None:
    """Sets this module's launch constants to SETTINGS[name] (function._input_grads reads them per call)."""
    globals().update(_DEFAULT_SETTINGS, **SETTINGS[name])


@triton.jit
def scan_bwd_kernel(do_ptr, p_ptr, kbar_ptr, qg_ptr, w_ptr, glast_ptr, dht_ptr, cu_ptr, chunk_offsets_ptr,
                    dh_ptr, dvnew_ptr, dh0_ptr,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                    PER_CHANNEL: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                    DOTS: tl.constexpr):
    """Per (sequence, head, V block), last chunk first: store dh (gradient of the state leaving the chunk),
    dv_new = P^T do + kbar dh, then dh <- e^gc_last dh + qg^T do - w^T dv_new. dh in fp32 registers; the
    products take their operands as common.mm's DOTS says ("bf16" rounds dh and dv_new as their stored
    copies are) and the tiles load in their stored dtype."""
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
        row0 = bos + c * C
        valid = (row0 + tl.arange(0, C) < eos)[:, None]
        tl.store(dh_ptr + state_offsets(chunk, head, col0, H, K, V, BV), dh.to(dh_ptr.dtype.element_ty))
        do = tl.load(rows_at(do_ptr, row0, head, H, V, col0, C, BV), mask=valid, other=0.0)
        p = tl.load(rows_at(p_ptr, row0, head, H, C, 0, C, C), mask=valid, other=0.0)
        kbar = tl.load(rows_at(kbar_ptr, row0, head, H, K, 0, C, K), mask=valid, other=0.0)
        dv_new = mm(tl.trans(p), do, DOTS) + mm(kbar, dh, DOTS)
        tl.store(rows_at(dvnew_ptr, row0, head, H, V, col0, C, BV), dv_new.to(dvnew_ptr.dtype.element_ty),
                 mask=valid)
        qg = tl.load(rows_at(qg_ptr, row0, head, H, K, 0, C, K), mask=valid, other=0.0)
        w = tl.load(rows_at(w_ptr, row0, head, H, K, 0, C, K), mask=valid, other=0.0)
        decay = load_chunk_decay(glast_ptr, chunk, head, H, K, PER_CHANNEL)
        dh = decay * dh + mm(tl.trans(qg), do, DOTS) - mm(tl.trans(w), dv_new, DOTS)
    if STORE_DH0:
        tl.store(dh0_ptr + seq_offs, dh)


@triton.jit
def l2norm_bwd(y, inv, dy, USE: tl.constexpr):
    """dx of y = x * inv with inv = (sum x^2 + eps)^-1/2: inv (dy - y (y . dy))."""
    if USE:
        dx = inv[:, None] * (dy - y * tl.sum(y * dy, 1)[:, None])
    else:
        dx = dy
    return dx


@triton.jit
def load_cols(ptr, start, valid_R, head, col0, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
              BD: tl.constexpr):
    """x_R,BD in fp32: rows start .. start + R, columns col0 .. col0 + BD of a packed [T, H, D] tensor (see
    forward.rows_at); rows past the sequence end read as 0."""
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
def inv_norms(x_ptr, start, valid_C, head, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
              USE: tl.constexpr):
    """1 / sqrt(sum x^2 + eps) of each row over all K, read in K blocks (ones when USE is off), as l2norm_rows."""
    sq_C = tl.zeros([C], tl.float32)
    if USE:
        for kb in tl.static_range(K // BK):
            x = load_cols(x_ptr, start, valid_C, head, kb * BK, H, K, C, BK)
            sq_C += tl.sum(x * x, 1)
        inv_C = 1.0 / tl.sqrt(sq_C + 1e-6)
    else:
        inv_C = sq_C + 1.0
    return inv_C


@triton.jit
def stored_inv_norms(norms_ptr, rows, slot: tl.constexpr, valid):
    """The inverse norms prep stored (KernelVariant.stored_norms) of rows (token * H + head) of [T, H, 2]: slot 0
    k's, slot 1 q's times the scale."""
    return tl.load(norms_ptr + rows.to(tl.int64) * 2 + slot, mask=valid, other=0.0)


@triton.jit
def row_scales(x_ptr, norms_ptr, slot: tl.constexpr, scale, start, valid_C, head, H: tl.constexpr, K: tl.constexpr,
               C: tl.constexpr, BK: tl.constexpr, USE: tl.constexpr, STORED: tl.constexpr):
    """scale / sqrt(sum x^2 + eps) of the chunk's rows (scale alone when USE is off): prep's stored inverse norms
    with STORED (slot 0 k's with scale 1, slot 1 q's), else recomputed by inv_norms."""
    if STORED:
        f_C = stored_inv_norms(norms_ptr, (start + tl.arange(0, C)) * H + head, slot, valid_C)
    else:
        f_C = inv_norms(x_ptr, start, valid_C, head, H, K, C, BK, USE) * scale
    return f_C


@triton.jit
def gc_block(g_ptr, tok_C, valid_C, start, head, col0, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
             BK: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """In-chunk cumulative log decay of key columns col0 .. col0 + BK: [C, BK] per channel, else [C, 1]."""
    if PER_CHANNEL:
        gc = tl.cumsum(load_cols(g_ptr, start, valid_C, head, col0, H, K, C, BK), 0)
    else:
        g = tl.load(g_ptr + tok_C.to(tl.int64) * H + head, mask=valid_C, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, 0)[:, None]
    return gc


@triton.jit
def state_block_offsets(chunk, head, row0, col0, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr):
    """Offsets of the [BK, BV] block at (row0, col0) of state `chunk` (of [NC, H, K, V]) for this head."""
    base = (chunk.to(tl.int64) * H + head) * K * V
    return base + (row0 + tl.arange(0, BK))[:, None] * V + col0 + tl.arange(0, BV)[None, :]


@triton.jit
def state_grad_kernel(q_ptr, k_ptr, g_ptr, h_ptr, dh_ptr, vnew_ptr, dvnew_ptr, do_ptr, chunk_start_ptr, chunk_end_ptr,
                      norms_ptr, dq_ptr, dk_ptr, dw_ptr, dgc_ptr, dgl_ptr, dpdiag_ptr, dpfull_ptr, gcs_ptr, scale,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, L2NORM: tl.constexpr,
                      PREC: tl.constexpr, DOTS: tl.constexpr, GRAM_APART: tl.constexpr, STORED_NORMS: tl.constexpr):
    """Per (chunk and K block, head): the state-side and P-path gradients (fp32, see the module docstring).
    Stores dq (complete before l2norm), dk's and dgc's shares, dw and dgc_last; per channel also the
    diagonal blocks of dP (the K block 0 program). GDN stores dgc summed over the block's channels in
    slot kb of dgc [T, H, NK + 1] and dgc_last in slot kb of dgl [NC, H, NK].
    GRAM_APART (per channel): P's decayed Gram backward is left to gram_grad_kernel, which gets the whole
    masked dP as rows [T, H, C] (dpfull) and the in-chunk cumulative decay gc [T, H, K] (gcs), both fp32.
    STORED_NORMS: q's and k's inverse norms come from prep's [T, H, 2] (norms_ptr) instead of loops over all K."""
    NK: tl.constexpr = K // BK
    # the K blocks of one chunk run side by side: the later ones read do, v_new and dv_new from L2
    chunk, kb, head = tl.program_id(0) // NK, tl.program_id(0) % NK, tl.program_id(1)
    tok, valid = chunk_tokens(chunk_start_ptr, chunk_end_ptr, chunk, C)
    start = tl.load(chunk_start_ptr + chunk)
    col0 = kb * BK
    dqg = tl.zeros([C, BK], tl.float32)
    dkbar = tl.zeros([C, BK], tl.float32)
    dw = tl.zeros([C, BK], tl.float32)
    dp = tl.zeros([C, C], tl.float32)
    dlam = tl.zeros([BK], tl.float32)
    for vb in range(V // BV):
        offs = state_block_offsets(chunk, head, col0, vb * BV, H, K, V, BK, BV)
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
    store_cols(dw_ptr, dw, start, valid, head, col0, H, K, C, BK)
    q = load_cols(q_ptr, start, valid, head, col0, H, K, C, BK) * row_scales(
        q_ptr, norms_ptr, 1, scale, start, valid, head, H, K, C, BK, L2NORM, STORED_NORMS)[:, None]
    k = load_cols(k_ptr, start, valid, head, col0, H, K, C, BK) * row_scales(
        k_ptr, norms_ptr, 0, 1.0, start, valid, head, H, K, C, BK, L2NORM, STORED_NORMS)[:, None]
    gc = gc_block(g_ptr, tok, valid, start, head, col0, H, K, C, BK, PER_CHANNEL)
    rows = tl.arange(0, C)
    dp = tl.where(rows[:, None] >= rows[None, :], dp, 0.0)
    if PER_CHANNEL:
        if kb == 0:
            store_diag(dpdiag_ptr, dp, tok, valid, head, H, C, S)
            if GRAM_APART:
                store_cols(dpfull_ptr, dp, start, valid, head, 0, H, C, C, C)
        if GRAM_APART:
            store_cols(gcs_ptr, gc, start, valid, head, col0, H, K, C, BK)
    # o = qg h + P v_new with qg = q e^gc; h_next = e^gc_last h + kbar^T v_new with kbar = k e^(gc_last - gc)
    dq = dqg * tl.exp(gc)
    gl = row_of(gc, C - 1, C)
    dk = dkbar * tl.exp(gl[None, :] - gc)
    dgl = tl.sum(k * dk, 0) + tl.exp(gl) * dlam
    if not (PER_CHANNEL and GRAM_APART):
        da, dc = decayed_gram_bwd(dp, q, k, gc, PER_CHANNEL, C, S, PREC)
        dq += da
        dk += dc
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
                   PREC: tl.constexpr, GRAD_DOTS: tl.constexpr, SLOT: tl.constexpr, GRAM_APART: tl.constexpr,
                   STORED_NORMS: tl.constexpr, FUSED_FINISH: tl.constexpr):
    """Per (chunk, head): gradients through u = Tinv (beta v), w = Tinv (beta k e^gc) and Tinv = (I + L)^-1.
    The products take common.mm's GRAD_DOTS (PREC: fp32 operands; "bf16": Tinv, dw, dTinv rounded, and for
    the scalar decay dL's products on the raw k).
    Stores dv and dbeta (per channel: dbeta's share before the diagonal blocks, in fp32, and the diagonal
    blocks of dL); adds its share to dk and dgc (per channel [T, H, K], else slot SLOT of [T, H, SLOT + 1],
    SLOT the number of state_grad_kernel's key blocks).
    GRAM_APART (per channel): gc comes from state_grad_kernel's gcs [T, H, K] instead of a cumsum, w's
    share of dk and dgc is added in the same key loop as dTinv's, and dL's decayed Gram backward is left
    to gram_grad_kernel (dL stored whole, masked, as rows [T, H, C] in dlfull): one key loop instead of two.
    STORED_NORMS: k's inverse norms from prep's [T, H, 2] (norms_ptr) instead of a loop over all K.
    FUSED_FINISH (scalar decay): does finish_kernel's work: the final dq and dk (final_dq, final_dk, through the
    l2norm) and dg from state_grad's slots of dgc and dgl plus its own dgc share, kept in registers (its slot of
    dgc is not written). dq first (its partial part_dq is complete after state_grad_kernel), dk and dg in the
    tail."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    NK: tl.constexpr = K // BK
    tok, valid = chunk_tokens(chunk_start_ptr, chunk_end_ptr, chunk, C)
    start = tl.load(chunk_start_ptr + chunk)
    beta = tl.load(beta_ptr + tok.to(tl.int64) * H + head, mask=valid, other=0.0).to(tl.float32)
    tinv = load_cols(tinv_ptr, start, valid, head, 0, H, C, C, C)
    k_inv = row_scales(k_ptr, norms_ptr, 0, 1.0, start, valid, head, H, K, C, BK, L2NORM, STORED_NORMS)
    # the scalar decay's [C, 1] gc serves every key block: loaded and summed once, off the loops' chains
    gc_rows = tl.zeros([C, 1], tl.float32)
    if not PER_CHANNEL:
        gc_rows = gc_block(g_ptr, tok, valid, start, head, 0, H, K, C, 1, False)
    if FUSED_FINISH and not PER_CHANNEL:
        # dq reads nothing this kernel writes: first, its loads beside Tinv's instead of a round in the tail
        q_inv = tl.zeros([C], tl.float32)
        if STORED_NORMS:
            q_inv = stored_inv_norms(norms_ptr, tok * H + head, 1, valid) / scale
        finish_rows(q_ptr, part_dq_ptr, final_dq_ptr, q_inv, scale, start, valid, head, H, K, C, L2NORM,
                    STORED_NORMS)
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
        k = load_cols(k_ptr, start, valid, head, kb * BK, H, K, C, BK) * k_inv[:, None]
        if GRAM_APART:
            gc = load_cols(gcs_ptr, start, valid, head, kb * BK, H, K, C, BK)
        elif PER_CHANNEL:
            gc = gc_block(g_ptr, tok, valid, start, head, kb * BK, H, K, C, BK, PER_CHANNEL)
        else:
            gc = gc_rows
        eg = tl.exp(gc)
        kt = k * eg
        dw = load_cols(dw_ptr, start, valid, head, kb * BK, H, K, C, BK)
        dtinv += mm(dw, tl.trans(beta[:, None] * kt), GRAD_DOTS)
        tdw = mm(tl.trans(tinv), dw, GRAD_DOTS)
        db += tl.sum(tdw * kt, 1)
        if GRAM_APART:
            # w = Tinv (beta k e^gc): dk += beta e^gc Tinv^T dw, dgc += k e^gc beta Tinv^T dw
            dkt = beta[:, None] * tdw
            add_cols(dk_ptr, dkt * eg, start, valid, head, kb * BK, H, K, C, BK)
            add_cols(dgc_ptr, kt * dkt, start, valid, head, kb * BK, H, K, C, BK)
    rows = tl.arange(0, C)
    # dL = -Tinv^T dTinv Tinv^T on L's strictly lower pattern
    dl = -mm(mm(tl.trans(tinv), dtinv, GRAD_DOTS), tl.trans(tinv), GRAD_DOTS)
    dl = tl.where(rows[:, None] > rows[None, :], dl, 0.0)
    dgc_rows = tl.zeros([C], tl.float32)
    if GRAM_APART:
        store_cols(dlfull_ptr, dl, start, valid, head, 0, H, C, C, C)
    else:
        for kb in range(NK):
            k = load_cols(k_ptr, start, valid, head, kb * BK, H, K, C, BK) * k_inv[:, None]
            if PER_CHANNEL:
                gc = gc_block(g_ptr, tok, valid, start, head, kb * BK, H, K, C, BK, PER_CHANNEL)
            else:
                gc = gc_rows
            eg = tl.exp(gc)
            # w's share, Tinv^T dw recomputed rather than kept over the dL products
            dkt = beta[:, None] * mm(tl.trans(tinv), load_cols(dw_ptr, start, valid, head, kb * BK, H, K, C, BK),
                                     GRAD_DOTS)
            if PER_CHANNEL or GRAD_DOTS == PREC:
                da, dc = decayed_gram_bwd(dl, beta[:, None] * k, k, gc, PER_CHANNEL, C, S, PREC)
            else:
                k_raw = tl.load(rows_at(k_ptr, start, head, H, K, kb * BK, C, BK), mask=valid[:, None], other=0.0)
                da, dc = scalar_gram_bwd(dl, k_raw, k_raw, beta * k_inv, k_inv, tl.sum(gc, 1), GRAD_DOTS)
            db += tl.sum(da * k, 1)
            dk = beta[:, None] * da + dc + dkt * eg
            dgc = k * (beta[:, None] * da - dc + eg * dkt)
            dk += load_cols(dk_ptr, start, valid, head, kb * BK, H, K, C, BK)
            store_cols(dk_ptr, dk, start, valid, head, kb * BK, H, K, C, BK)
            if PER_CHANNEL:
                dgc += load_cols(dgc_ptr, start, valid, head, kb * BK, H, K, C, BK)
                store_cols(dgc_ptr, dgc, start, valid, head, kb * BK, H, K, C, BK)
            else:
                dgc_rows += tl.sum(dgc, 1)
    if PER_CHANNEL:
        store_diag(dldiag_ptr, dl, tok, valid, head, H, C, S)
    elif not FUSED_FINISH:
        tl.store(dgc_ptr + (tok.to(tl.int64) * H + head) * (SLOT + 1) + SLOT, dgc_rows, mask=valid)
    tl.store(db_ptr + tok.to(tl.int64) * H + head, db.to(db_ptr.dtype.element_ty), mask=valid)
    if FUSED_FINISH and not PER_CHANNEL:
        # state_grad's dg shares load during the barrier and the dk round (not held over the loops: spills)
        state_dgc, dgl = state_dg_shares(dgc_ptr, dgl_ptr, tok, valid, chunk, head, H, SLOT)
        # the dk partial re-read whole below was stored by the key loop's threads in other layouts
        tl.debug_barrier()
        finish_rows(k_ptr, dk_ptr, final_dk_ptr, k_inv, 1.0, start, valid, head, H, K, C, L2NORM, True)
        store_dg(dg_ptr, state_dgc + dgc_rows, dgl, tok, valid, head, H)


@triton.jit
def sub_chunk_rows(ptr, norms_ptr, slot: tl.constexpr, scale, start, valid_S, head, H: tl.constexpr, K: tl.constexpr,
                   S: tl.constexpr, L2NORM: tl.constexpr, STORED: tl.constexpr):
    """x_SK in fp32, l2-normalized over K (with L2NORM) and times scale: the S rows of a sub-chunk of a packed
    [T, H, K] tensor, with prep's stored inverse norms (STORED, see row_scales) or recomputed."""
    x = load_cols(ptr, start, valid_S, head, 0, H, K, S, K)
    if STORED:
        y = x * stored_inv_norms(norms_ptr, (start + tl.arange(0, S)) * H + head, slot, valid_S)[:, None]
    else:
        y = l2norm_rows(x, 1e-6, L2NORM)[0] * scale
    return y


@triton.jit
def gram_grad_kernel(q_ptr, k_ptr, beta_ptr, gcs_ptr, dl_ptr, dp_ptr, norms_ptr, chunk_start_ptr, chunk_end_ptr,
                     part_dq_ptr, part_dk_ptr, part_dgc_ptr, part_db_ptr, scale,
                     H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, S: tl.constexpr, L2NORM: tl.constexpr,
                     PREC: tl.constexpr, STORED_NORMS: tl.constexpr):
    """Per (sub-chunk b of a chunk, head), per-channel decay with KernelVariant.gram_grad_apart: the share of the
    off-diagonal S x S blocks of L = beta gram(k, k) and P = gram(q, k) in the gradients of sub-chunk b's rows,
    added in place to the partial dq, dk, dgc [T, H, K] and dbeta [T, H] (each program owns its rows; the
    diagonal blocks stay with diagonal.py). dL and dP come whole as rows [T, H, C] (masked to their
    patterns), gc as [T, H, K]: all fp32.
    As a row (a = beta k or q): da_i = e^(gc_i - r) sum_{j < bS} dM_ij k_j e^(r - gc_j), r the gc of row bS;
    as a column: dc_j = sum over later sub-chunks c (reference r_c, the gc of row cS) of
    e^(r_c - gc_j) sum_i dM_ij a_i e^(gc_i - r_c). Every exponent is <= 0, so no factor overflows for any
    decay; [S, S] x [S, K] tf32 products (PREC) over whole-K tiles loaded from L2. STORED_NORMS: q's and k's inverse
    norms from prep's [T, H, 2] (norms_ptr) instead of a reduction over K per sub-chunk walked."""
    NS: tl.constexpr = C // S
    chunk, b, head = tl.program_id(0) // NS, tl.program_id(0) % NS, tl.program_id(1)
    chunk_start, chunk_end = tl.load(chunk_start_ptr + chunk), tl.load(chunk_end_ptr + chunk)
    start = chunk_start + b * S
    if start < chunk_end:
        valid = start + tl.arange(0, S) < chunk_end
        k = sub_chunk_rows(k_ptr, norms_ptr, 0, 1.0, start, valid, head, H, K, S, L2NORM, STORED_NORMS)
        q = sub_chunk_rows(q_ptr, norms_ptr, 1, scale, start, valid, head, H, K, S, L2NORM, STORED_NORMS)
        beta = tl.load(beta_ptr + (start + tl.arange(0, S)).to(tl.int64) * H + head, mask=valid,
                       other=0.0).to(tl.float32)
        gc = load_cols(gcs_ptr, start, valid, head, 0, H, K, S, K)
        da_l, da_p = gram_rows_grad(k_ptr, gcs_ptr, dl_ptr, dp_ptr, norms_ptr, chunk_start, start, valid, gc, head, b,
                                    H, K, C, S, L2NORM, PREC, STORED_NORMS)
        dc = gram_cols_grad(q_ptr, k_ptr, beta_ptr, gcs_ptr, dl_ptr, dp_ptr, norms_ptr, chunk_start, chunk_end, start,
                            gc, head, b, scale, H, K, C, S, L2NORM, PREC, STORED_NORMS)
        add_cols(part_dq_ptr, da_p, start, valid, head, 0, H, K, S, K)
        add_cols(part_dk_ptr, beta[:, None] * da_l + dc, start, valid, head, 0, H, K, S, K)
        add_cols(part_dgc_ptr, k * (beta[:, None] * da_l - dc) + q * da_p, start, valid, head, 0, H, K, S, K)
        db_offs = (start + tl.arange(0, S)).to(tl.int64) * H + head
        db = tl.load(part_db_ptr + db_offs, mask=valid, other=0.0) + tl.sum(da_l * k, 1)
        tl.store(part_db_ptr + db_offs, db, mask=valid)


@triton.jit
def gram_rows_grad(k_ptr, gcs_ptr, dl_ptr, dp_ptr, norms_ptr, chunk_start, start, valid_S, gc_SK, head, b,
                   H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, S: tl.constexpr, L2NORM: tl.constexpr,
                   PREC: tl.constexpr, STORED: tl.constexpr):
    """(da of L, da of P) of sub-chunk b's rows against the earlier sub-chunks (see gram_grad_kernel)."""
    ref_K = tl.load(gcs_ptr + (start.to(tl.int64) * H + head) * K + tl.arange(0, K))
    acc_l = tl.zeros([S, K], tl.float32)
    acc_p = tl.zeros([S, K], tl.float32)
    every = tl.full([S], 1, tl.int1)
    for jb in range(b):
        row0 = chunk_start + jb * S
        k_j = sub_chunk_rows(k_ptr, norms_ptr, 0, 1.0, row0, every, head, H, K, S, L2NORM, STORED)
        kc = k_j * tl.exp(ref_K[None, :] - load_cols(gcs_ptr, row0, every, head, 0, H, K, S, K))
        acc_l += tl.dot(load_cols(dl_ptr, start, valid_S, head, jb * S, H, C, S, S), kc, input_precision=PREC)
        acc_p += tl.dot(load_cols(dp_ptr, start, valid_S, head, jb * S, H, C, S, S), kc, input_precision=PREC)
    # rows past the chunk's end read gc 0: their factor is held at 0 instead of e^-ref
    fa = tl.where(valid_S[:, None], tl.exp(gc_SK - ref_K[None, :]), 0.0)
    return acc_l * fa, acc_p * fa


@triton.jit
def gram_cols_grad(q_ptr, k_ptr, beta_ptr, gcs_ptr, dl_ptr, dp_ptr, norms_ptr, chunk_start, chunk_end, start,
                   gc_SK, head, b, scale, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                   L2NORM: tl.constexpr, PREC: tl.constexpr, STORED: tl.constexpr):
    """dc (both matrices' share of dk as the column key) of sub-chunk b's rows against the later sub-chunks."""
    dc = tl.zeros([S, K], tl.float32)
    for ib in range(b + 1, tl.cdiv(chunk_end - chunk_start, S)):
        row0 = chunk_start + ib * S
        valid_i = row0 + tl.arange(0, S) < chunk_end
        ref_K = tl.load(gcs_ptr + (row0.to(tl.int64) * H + head) * K + tl.arange(0, K))
        fa = tl.where(valid_i[:, None],
                      tl.exp(load_cols(gcs_ptr, row0, valid_i, head, 0, H, K, S, K) - ref_K[None, :]), 0.0)
        k_i = sub_chunk_rows(k_ptr, norms_ptr, 0, 1.0, row0, valid_i, head, H, K, S, L2NORM, STORED)
        q_i = sub_chunk_rows(q_ptr, norms_ptr, 1, scale, row0, valid_i, head, H, K, S, L2NORM, STORED)
        beta_i = tl.load(beta_ptr + (row0 + tl.arange(0, S)).to(tl.int64) * H + head, mask=valid_i, other=0.0)
        dl_t = tl.trans(load_cols(dl_ptr, row0, valid_i, head, b * S, H, C, S, S))
        dp_t = tl.trans(load_cols(dp_ptr, row0, valid_i, head, b * S, H, C, S, S))
        part = tl.dot(dl_t, beta_i.to(tl.float32)[:, None] * k_i * fa, input_precision=PREC)
        part += tl.dot(dp_t, q_i * fa, input_precision=PREC)
        dc += part * tl.exp(ref_K[None, :] - gc_SK)
    return dc


@triton.jit
def finish_rows(x_ptr, part_ptr, out_ptr, inv_C, dy_scale, start, valid_C, head, H: tl.constexpr, K: tl.constexpr,
                C: tl.constexpr, L2NORM: tl.constexpr, KNOWN_INV: tl.constexpr):
    """Stores dx (out_ptr's dtype) of the chunk's whole rows through the l2norm, from the complete partial gradient
    part * dy_scale of the normalized rows; their inverse norms inv_C given (KNOWN_INV) or recomputed from x."""
    x = load_cols(x_ptr, start, valid_C, head, 0, H, K, C, K)
    if KNOWN_INV:
        y = x * inv_C[:, None]
    else:
        y, inv_C = l2norm_rows(x, 1e-6, L2NORM)
    dx = l2norm_bwd(y, inv_C, load_cols(part_ptr, start, valid_C, head, 0, H, K, C, K) * dy_scale, L2NORM)
    store_cols(out_ptr, dx, start, valid_C, head, 0, H, K, C, K)


@triton.jit
def state_dg_shares(dgc_ptr, dgl_ptr, tok_C, valid_C, chunk, head, H: tl.constexpr, NK: tl.constexpr):
    """Scalar decay: (dgc_C summed over state_grad_kernel's NK slots of dgc [T, H, NK + 1], dgc_last summed over the
    NK slots of dgl [NC, H, NK])."""
    row_offs = (tok_C.to(tl.int64) * H + head) * (NK + 1)
    dgc = tl.zeros([tok_C.shape[0]], tl.float32)
    for slot in tl.static_range(NK):
        dgc += tl.load(dgc_ptr + row_offs + slot, mask=valid_C, other=0.0)
    dgl = 0.0
    for slot in tl.static_range(NK):
        dgl += tl.load(dgl_ptr + (chunk.to(tl.int64) * H + head) * NK + slot)
    return dgc, dgl


@triton.jit
def store_dg(dg_ptr, dgc_C, dgl, tok_C, valid_C, head, H: tl.constexpr):
    """Scalar decay: dg = dgc_last + the reverse cumsum of dgc over the chunk."""
    dg = dgl + tl.sum(dgc_C, 0) - tl.cumsum(dgc_C, 0) + dgc_C
    tl.store(dg_ptr + tok_C.to(tl.int64) * H + head, dg.to(dg_ptr.dtype.element_ty), mask=valid_C)


@triton.jit
def finish_kernel(q_ptr, k_ptr, norms_ptr, part_dq_ptr, part_dk_ptr, dgc_ptr, dgl_ptr, chunk_start_ptr,
                  chunk_end_ptr, dq_ptr, dk_ptr, dg_ptr, scale, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                  NK: tl.constexpr, L2NORM: tl.constexpr, STORED_NORMS: tl.constexpr):
    """Per (chunk, head), scalar decay: dq and dk through l2norm (STORED_NORMS: with prep's inverse norms, else
    recomputed), dg = dgc_last + reverse cumsum of dgc (the NK + 1 slots of dgc and the NK of dgl summed)."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    tok, valid = chunk_tokens(chunk_start_ptr, chunk_end_ptr, chunk, C)
    start = tl.load(chunk_start_ptr + chunk)
    q_inv = tl.zeros([C], tl.float32)
    k_inv = tl.zeros([C], tl.float32)
    if STORED_NORMS:
        q_inv = stored_inv_norms(norms_ptr, tok * H + head, 1, valid) / scale
        k_inv = stored_inv_norms(norms_ptr, tok * H + head, 0, valid)
    finish_rows(q_ptr, part_dq_ptr, dq_ptr, q_inv, scale, start, valid, head, H, K, C, L2NORM, STORED_NORMS)
    finish_rows(k_ptr, part_dk_ptr, dk_ptr, k_inv, 1.0, start, valid, head, H, K, C, L2NORM, STORED_NORMS)
    dgc, dgl = state_dg_shares(dgc_ptr, dgl_ptr, tok, valid, chunk, head, H, NK)
    dgc += tl.load(dgc_ptr + (tok.to(tl.int64) * H + head) * (NK + 1) + NK, mask=valid, other=0.0)
    store_dg(dg_ptr, dgc, dgl, tok, valid, head, H)
