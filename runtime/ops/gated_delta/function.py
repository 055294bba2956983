"""Autograd function over the GDN/KDA Triton kernels: buffers, launches and the packed layout.

Batch is folded into time: [B, T, H, *] becomes [B*T, H, *] with B sequences given by cu_seqlens,
so one set of kernels serves the batched and the packed (varlen) case.
GDN (scalar decay) launches prep_blocked, scan (o included), then scan_bwd, state_grad and wy_grad (which
also finishes dq, dk and dg). KDA (per-channel decay) first computes the exact diagonal blocks of its
decayed Gram matrices token-parallel (diag_token) before prep, and in the backward adds
gram_grad (the off-diagonal decayed Gram backward), diag_grad_token and dg_finish: the per-channel decay
makes those products too heavy to share a kernel with the rest. On Hopper GDN's prep, state_grad and wy_grad run as
Gluon kernels with the same contracts (gluon/wy_representation.py, state_grad.py, wy_representation_grad.py) where
the shapes fit and the backend selector (backend.py) chose "hopper". The forward keeps its chunk tiles, Tinv and
states for the backward whenever grad is enabled; intermediates are stored as Storage says.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim, N sequences, NC chunks over all
sequences, C chunk size, S sub-chunk size, X 1 (GDN) or K (KDA).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from runtime.ops.common import buffers
from runtime.ops.gated_delta import backward, diagonal, forward
from runtime.ops.gated_delta.gluon import (
    state_grad as gluon_state_grad, wy_representation as gluon_wy, wy_representation_grad as gluon_wy_grad,
)
from runtime.ops.common.launch import fast, interpreting

CHUNK_SIZE = 64
SUB_CHUNK = 16
# tf32 keeps the in-chunk products within ~1e-3 of fp32 and runs on tensor cores
DOT_PRECISION = "tf32"
# prep_blocked_kernel's column block: no [C, K] fp32 tile stays live across the chunk's matrices
PREP_BLOCK = 64
# KDA's: its keys weighed per target sub-chunk ([C / S, C, BD] fp32, common.decayed_grams) fit registers at 16
# columns, with three programs an SM
DECAYED_GRAM_BLOCK = 16
# 4-warp prep programs: faster than one 8-warp program
PREP_WARPS = 4
# KDA's column outputs in prep_blocked_kernel, after Tinv: 64 columns a block take fewer dependent load rounds than
# 32 or 16 (under the register cap below)
PREP_COLUMN_BLOCK = 64
# prep_blocked_kernel's register cap by (per_channel, for a backward): three 4-warp KDA programs an SM (168 x 128
# threads x 3 of 65536; uncapped its column tiles take it to two); GDN's forward without grad four programs
# (faster than three, though a little of it goes to local memory), with grad three (storing Tinv and the norms
# does not fit the cap of four)
PREP_REGISTERS = {(True, False): 168, (True, True): 168, (False, False): 128, (False, True): 168}
# value block of both scans: a smaller block runs more programs (V / block per sequence and head)
SCAN_VALUE_BLOCK = 32
# the scans prefetch chunks' tiles: they are latency-bound, one program per SM. At 2 stages the loads are issued at
# the end of the step before the one that waits on them, so their latency stays in every step; at 3 one chunk's
# loads stay in flight through a whole step: 200 KB of shared memory at K = V = 128 (2 stages: 139 KB), which a
# Hopper block takes (227 KB) and an A100's (164 KB) does not
SCAN_STAGES, SCAN_STAGES_SHARED_BYTES = 3, 200 * 1024
# one warpgroup matches the forward scan's M=64 products; the backward scan carries more tiles per step
FORWARD_SCAN_WARPS = 4
BACKWARD_SCAN_WARPS = 8
# heads per program of the token-parallel diagonal gradient kernel, one warp each (the reductions over K stay in a
# warp)
TOKEN_DIAG_HEADS = 4
# the forward's diagonal kernel is issue-bound: 8 heads on 2 warps hold 16 channels a thread, whose pairs share
# their reductions over K and the loop's overhead (sm_90a: 52 instructions a head and pair, 88 at a warp a head)
DIAG_TOKEN_HEADS, DIAG_TOKEN_HEADS_PER_WARP = 8, 4
# dg_finish_kernel's channel block: a cumsum over whole [C, K] rows holds too many registers
DG_FINISH_BLOCK = 32
# key blocks of the gradient kernels: state_grad's four [C, BK] fp32 accumulators fit registers at 32; wy_grad's
# chain of key steps is shorter at 64
STATE_GRAD_KEY_BLOCK = 32
KEY_BLOCK = 64
# value block of the gradient kernels' loops over V
VALUE_BLOCK = 64
# state_grad and wy_grad at 4 warps fit two programs per SM; unpipelined, as their fp32 tiles fill shared memory
GRAD_WARPS = 4
GRAD_STAGES = 1
# gram_grad_kernel at 4 warps fits two programs per SM
GRAM_GRAD_WARPS = 4
# register caps of KDA's state_grad_kernel and gram_grad_kernel: three 4-warp programs an SM at 168 (168 x 128
# threads x 3 of 65536) where uncapped they run two; faster so, though a little goes to local memory. GDN's
# state_grad fits the cap uncapped
STATE_GRAD_REGISTERS = {True: 168, False: None}
GRAM_GRAD_REGISTERS = 168


def scan_stages(device: torch.device) -> int:
    """The scans' pipeline depth: SCAN_STAGES where the GPU's shared memory per block takes them, else 2."""
    if device.type != "cuda":
        return SCAN_STAGES
    return SCAN_STAGES if _shared_bytes_per_block(device.index or 0) >= SCAN_STAGES_SHARED_BYTES else 2


@functools.cache
def _shared_bytes_per_block(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    # ROCm's properties lack the opt-in figure
    return getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)


@dataclass(frozen=True)
class Storage:
    """How intermediates are stored, a function of the input dtype: bf16 halves the bytes the scans and the
    gradient kernels read; fp32 inputs keep fp32 intermediates (bf16 storage would hold an fp32 run to bf16
    precision). u, gc_last, the norms, the final state and the gradient scratch stay fp32 either way."""

    # qg, kbar, w, P, Tinv, v_new, dv_new, dw and the per-chunk states h, dh
    dtype: torch.dtype
    # common.mm's PREC for the products on those tiles: bf16 operands round them as they are stored
    dots: str

    @staticmethod
    def of(input_dtype: torch.dtype) -> "Storage":
        if input_dtype == torch.float32:
            return Storage(torch.float32, DOT_PRECISION)
        return Storage(torch.bfloat16, _bf16_dots())


def _bf16_dots() -> str:
    """common.mm's PREC for bf16 operands: the interpreter's bf16 tl.dot is wrong, so it gets the same rounding
    with an fp32 product."""
    return "bf16_rounded" if interpreting() else "bf16"


class ChunkLayout:
    """Where each chunk of each packed sequence starts and ends (int32 device tensors). num_chunks, where the caller
    knows it, spares the device-to-host sync that counting the chunks takes."""

    def __init__(self, cu_seqlens: torch.Tensor, chunk_size: int, num_chunks: int | None = None):
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        chunks_per_seq = (lengths + chunk_size - 1) // chunk_size
        chunk_offsets = torch.cat([chunks_per_seq.new_zeros(1), chunks_per_seq.cumsum(0)])
        seq_of_chunk = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), chunks_per_seq,
                                               output_size=num_chunks)
        index_in_seq = torch.arange(len(seq_of_chunk), device=cu_seqlens.device) - chunk_offsets[seq_of_chunk]
        start = cu_seqlens[seq_of_chunk] + index_in_seq * chunk_size
        end = torch.minimum(start + chunk_size, cu_seqlens[seq_of_chunk + 1])
        self.cu_seqlens, self.chunk_offsets = cu_seqlens.to(torch.int32), chunk_offsets.to(torch.int32)
        self.chunk_start, self.chunk_end = start.to(torch.int32), end.to(torch.int32)
        self.num_seqs, self.num_chunks = len(lengths), len(start)


@functools.lru_cache(maxsize=32)
def _batched_layout(batch: int, num_tokens: int, chunk_size: int, device: torch.device) -> ChunkLayout:
    """The layout of B sequences of T tokens, built once per shape and chunk size: its small launches cost
    host time on every layer's forward (the kernels only read it)."""
    cu_seqlens = torch.arange(batch + 1, device=device) * num_tokens
    return ChunkLayout(cu_seqlens, chunk_size, batch * -(-num_tokens // chunk_size))


def _token_diag_heads(num_heads: int, most: int = TOKEN_DIAG_HEADS) -> int:
    """most, or the largest power of two below it dividing H."""
    heads = most
    while num_heads % heads:
        heads //= 2
    return heads


def _token_diagonals(q, k, g, layout):
    """KDA: the exact diagonal blocks of the decayed Gram products k k^T and q k^T of the raw inputs, as rows
    [T, H, S] fp32 (diagonal.diag_token_kernel)."""
    num_tokens, num_heads, key_dim = q.shape
    ldiag, pdiag = (buffers.empty(num_tokens, num_heads, SUB_CHUNK, dtype=torch.float32, device=q.device)
                    for _ in range(2))
    heads = _token_diag_heads(num_heads, DIAG_TOKEN_HEADS)
    fast(diagonal.diag_token_kernel)[(layout.num_chunks * CHUNK_SIZE, num_heads // heads)](
        q, k, g, layout.chunk_start, layout.chunk_end, ldiag, pdiag, H=num_heads, K=key_dim, C=CHUNK_SIZE,
        S=SUB_CHUNK, BH=heads, num_warps=max(1, heads // DIAG_TOKEN_HEADS_PER_WARP))
    return ldiag, pdiag


def _prep(q, k, v, g, beta, layout, scale, per_channel, l2norm, for_backward, storage):
    """Chunk-local quantities as a dict: w, P in storage.dtype; u, gc_last fp32; per channel qg, kbar in
    storage.dtype, for the scalar decay their factors by row ("row_scales" [T, H, 2] fp32: see _scan_keys); Tinv
    [T, H, C] in storage.dtype and the rows' inverse norms [T, H, 2] fp32 where a backward (with the qk l2norm for
    the norms) reads them, else None."""
    num_tokens, num_heads, key_dim = q.shape
    f32 = dict(dtype=torch.float32, device=q.device)
    tiles = dict(dtype=storage.dtype, device=q.device)
    out = {"w": buffers.empty(num_tokens, num_heads, key_dim, **tiles), "qg": None, "kbar": None, "row_scales": None}
    if per_channel:
        out["qg"], out["kbar"] = (buffers.empty(num_tokens, num_heads, key_dim, **tiles) for _ in range(2))
    else:
        out["row_scales"] = buffers.empty(num_tokens, num_heads, 2, **f32)
    out["u"] = buffers.empty(*v.shape, **f32)
    out["p"] = buffers.empty(num_tokens, num_heads, CHUNK_SIZE, **tiles)
    out["glast"] = buffers.empty(layout.num_chunks, num_heads, key_dim if per_channel else 1, **f32)
    # the backward kernels read the norms instead of summing q^2 and k^2 over K again; Tinv in the storage dtype, as
    # every product that reads it (wy_grad's, at storage.dots) rounds it to that precision anyway
    out["tinv"] = buffers.empty(num_tokens, num_heads, CHUNK_SIZE, **tiles) if for_backward else None
    out["norms"] = buffers.empty(num_tokens, num_heads, 2, **f32) if for_backward and l2norm else None
    _prep_launches(q, k, v, g, beta, layout, scale, per_channel, l2norm, out)
    return out


def _prep_launches(q, k, v, g, beta, layout, scale, per_channel, l2norm, out):
    """forward.prep_blocked_kernel writing the buffers of out, for KDA after its diagonal blocks; on Hopper GDN's Gluon
    twin (gluon_wy.prep) where the shapes fit and it compiles."""
    num_heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[-1]
    if (gluon_wy.use_prep(q, v, CHUNK_SIZE, per_channel)
            and gluon_wy.prep(q, k, v, g, beta, layout.chunk_start, layout.chunk_end, out["w"], out["u"], out["p"],
                                 out["glast"], out["row_scales"], out["tinv"], out["norms"], scale, l2norm)):
        return
    diags = _token_diagonals(q, k, g, layout) if per_channel else (None, None)
    block = DECAYED_GRAM_BLOCK if per_channel else PREP_BLOCK
    columns = PREP_COLUMN_BLOCK if per_channel else PREP_BLOCK
    # bf16 operands: exact for the raw Gram products of bf16 inputs; w's and u's (Tinv times a column block) round
    # Tinv as a stored tile would be, and move half the operand bytes through shared memory
    tiles = _bf16_dots() if q.dtype == torch.bfloat16 else DOT_PRECISION
    fast(forward.prep_blocked_kernel)[(layout.num_chunks, num_heads)](
        q, k, v, g, beta, layout.chunk_start, layout.chunk_end,
        out["qg"], out["kbar"], out["w"], out["u"], out["p"], out["glast"], out["tinv"], out["norms"], *diags,
        out["row_scales"], scale, H=num_heads, K=key_dim, V=value_dim, BD=min(block, key_dim, value_dim),
        BC=min(columns, key_dim, value_dim), PER_CHANNEL=per_channel, L2NORM=l2norm, TILE_PREC=tiles,
        num_warps=PREP_WARPS, maxnreg=PREP_REGISTERS[per_channel, out["tinv"] is not None], C=CHUNK_SIZE, S=SUB_CHUNK,
        PREC=DOT_PRECISION)


def _scan_keys(prep, q, k):
    """(qg or q, kbar or k, the row scales or None) as the scans read them. The scalar decay's qg and kbar are q
    and k (l2-normed, scaled, decayed) with one factor a row: prep stores the factors, not the tiles, and the scans
    apply them to the other operand of each product, reading q and k as they came."""
    if prep["row_scales"] is None:
        return prep["qg"], prep["kbar"], None
    return q, k, prep["row_scales"]


def _scan(prep, q, k, h0, layout, per_channel, out_dtype, storage, for_backward):
    """(h entering every chunk [NC, H, K, V], v_new [T, H, V], final state [N, H, K, V] fp32, o [T, H, V] in
    out_dtype); h and v_new are None without a backward, which alone reads them."""
    num_tokens, num_heads, key_dim = prep["w"].shape
    value_dim = prep["u"].shape[-1]
    device = prep["w"].device
    h = v_new = None
    if for_backward:
        h = buffers.empty(layout.num_chunks, num_heads, key_dim, value_dim, dtype=storage.dtype, device=device)
        v_new = buffers.empty(num_tokens, num_heads, value_dim, dtype=storage.dtype, device=device)
    final = buffers.empty(layout.num_seqs, num_heads, key_dim, value_dim, dtype=torch.float32, device=device)
    o = buffers.empty(num_tokens, num_heads, value_dim, dtype=out_dtype, device=device)
    block = min(SCAN_VALUE_BLOCK, value_dim)
    qg, kbar, row_scales = _scan_keys(prep, q, k)
    fast(forward.scan_kernel)[(layout.num_seqs, num_heads, value_dim // block)](
        prep["w"], prep["u"], kbar, prep["glast"], h0, qg, prep["p"], row_scales, layout.cu_seqlens,
        layout.chunk_offsets, h, v_new, final, o, H=num_heads, K=key_dim, V=value_dim, C=CHUNK_SIZE, BV=block,
        PER_CHANNEL=per_channel, PREC=storage.dots, num_warps=FORWARD_SCAN_WARPS, num_stages=scan_stages(device))
    return h, v_new, final, o


def _scan_bwd(prep, q, k, do, dht, layout, per_channel, want_dh0, storage):
    """(dh leaving every chunk [NC, H, K, V], dv_new [T, H, V], dh0 [N, H, K, V] fp32 or None); dht may be None."""
    num_tokens, num_heads, key_dim = prep["w"].shape
    value_dim = do.shape[-1]
    device = do.device
    dh = buffers.empty(layout.num_chunks, num_heads, key_dim, value_dim, dtype=storage.dtype, device=device)
    dv_new = buffers.empty(num_tokens, num_heads, value_dim, dtype=storage.dtype, device=device)
    dh0 = None
    if want_dh0:
        dh0 = buffers.empty(layout.num_seqs, num_heads, key_dim, value_dim, dtype=torch.float32, device=device)
    block = min(SCAN_VALUE_BLOCK, value_dim)
    qg, kbar, row_scales = _scan_keys(prep, q, k)
    fast(backward.scan_bwd_kernel)[(layout.num_seqs, num_heads, value_dim // block)](
        do, prep["p"], kbar, qg, prep["w"], prep["glast"], row_scales, dht, layout.cu_seqlens, layout.chunk_offsets,
        dh, dv_new, dh0, H=num_heads, K=key_dim, V=value_dim, C=CHUNK_SIZE, BV=block, PER_CHANNEL=per_channel,
        DOTS=storage.dots, num_warps=BACKWARD_SCAN_WARPS, num_stages=scan_stages(device))
    return dh, dv_new, dh0


def _input_grads(q, k, v, g, beta, do, prep, h, dh, v_new, dv_new, layout, scale, per_channel, l2norm, storage):
    """(dq, dk, dv, dg, dbeta) in the inputs' dtypes, by the backward launches of the module docstring. With the
    qk l2norm every kernel reads the inverse norms prep stored."""
    num_tokens, num_heads, key_dim = q.shape
    dq, dk, dv, dg, dbeta = [buffers.empty(*t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v, g, beta)]
    s = _grad_scratch(q, layout, per_channel, _state_grad_key_blocks(key_dim), storage)
    dims = dict(H=num_heads, K=key_dim, C=CHUNK_SIZE, L2NORM=l2norm)
    norms = prep["norms"]
    _state_grad(q, k, g, h, dh, v_new, dv_new, do, layout, scale, per_channel, l2norm, norms, s, storage)
    _wy_grad(q, k, v, g, beta, prep["tinv"], dv_new, layout, scale, per_channel, l2norm, norms, s, storage,
             (dq, dk, dv, dg, dbeta))
    if per_channel:
        _diagonal_grads(q, k, g, beta, norms, s, layout, scale, dq, dk, dg, dbeta, dims)
    return dq, dk, dv, dg, dbeta


def _state_grad(q, k, g, h, dh, v_new, dv_new, do, layout, scale, per_channel, l2norm, norms, s, storage):
    """backward.state_grad_kernel into the scratch s (_grad_scratch's), or on Hopper its Gluon twin (GDN's or
    KDA's, gluon_state_grad.state_grad) where the shapes fit and it compiles."""
    num_heads, key_dim, value_dim = q.shape[1], q.shape[2], v_new.shape[-1]
    key_block = min(STATE_GRAD_KEY_BLOCK, key_dim)
    bounds = (layout.chunk_start, layout.chunk_end)
    scratch = (s["dq"], s["dk"], s["dw"], s["dgc"], s["dgl"], s["dpdiag"], s["dpfull"], s["gcs"])
    if (gluon_state_grad.use_state_grad(q, h, CHUNK_SIZE, key_block, per_channel)
            and gluon_state_grad.state_grad(q, k, g, h, dh, v_new, dv_new, do, *bounds, norms, *scratch, scale, l2norm,
                                  per_channel)):
        return
    fast(backward.state_grad_kernel)[(layout.num_chunks * (key_dim // key_block), num_heads)](
        q, k, g, h, dh, v_new, dv_new, do, *bounds, norms, *scratch, scale,
        H=num_heads, K=key_dim, V=value_dim, C=CHUNK_SIZE, S=SUB_CHUNK, BK=key_block, BV=min(VALUE_BLOCK, value_dim),
        PER_CHANNEL=per_channel, L2NORM=l2norm, PREC=DOT_PRECISION, DOTS=storage.dots, num_warps=GRAD_WARPS,
        num_stages=GRAD_STAGES, maxnreg=STATE_GRAD_REGISTERS[per_channel])


def _state_grad_key_blocks(key_dim: int) -> int:
    """state_grad_kernel's key blocks: the slots of GDN's dgc and dgl it writes and wy_grad reads."""
    return key_dim // min(STATE_GRAD_KEY_BLOCK, key_dim)


def _wy_grad(q, k, v, g, beta, tinv, dv_new, layout, scale, per_channel, l2norm, norms, s, storage, grads):
    """backward.wy_grad_kernel from the scratch s (_grad_scratch's, after _state_grad) into grads (dq, dk, dv, dg,
    dbeta: _input_grads' buffers; KDA's dq, dk, dg, dbeta are written later, by _diagonal_grads), or on Hopper its
    Gluon twin for GDN (gluon_wy_grad.wy_grad) where the shapes fit and it compiles."""
    dq, dk, dv, dg, dbeta = grads
    num_heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[-1]
    bounds = (layout.chunk_start, layout.chunk_end)
    if (gluon_wy_grad.use_wy_grad(q, v, dv_new, CHUNK_SIZE, per_channel)
            and gluon_wy_grad.wy_grad(q, k, v, g, beta, tinv, dv_new, s["dw"], s["dq"], s["dk"], s["dgc"], s["dgl"], norms,
                                  *bounds, dv, dq, dk, dbeta, dg, scale, l2norm)):
        return
    fast(backward.wy_grad_kernel)[(layout.num_chunks, num_heads)](
        q, k, v, g, beta, tinv, dv_new, s["dw"], norms, *bounds, dv, s["dk"], s["dgc"],
        s["db"] if per_channel else dbeta, s["dldiag"], s["dlfull"], s["gcs"], s["dq"], s["dgl"], dq, dk, dg, scale,
        H=num_heads, K=key_dim, V=value_dim, C=CHUNK_SIZE, S=SUB_CHUNK, BK=min(KEY_BLOCK, key_dim),
        BV=min(VALUE_BLOCK, value_dim), PER_CHANNEL=per_channel, L2NORM=l2norm, PREC=DOT_PRECISION,
        GRAD_DOTS=storage.dots, SLOT=_state_grad_key_blocks(key_dim), num_warps=GRAD_WARPS, num_stages=GRAD_STAGES)


def _diagonal_grads(q, k, g, beta, norms, s, layout, scale, dq, dk, dg, dbeta, dims):
    """KDA: the decayed Gram backward off the diagonal blocks (gram_grad_kernel), then the diagonal blocks' share
    with the final dq, dk, dbeta (diag_grad_token_kernel) and dg's reverse cumsum (dg_finish_kernel)."""
    num_heads, key_dim = q.shape[1], q.shape[2]
    bounds = (layout.chunk_start, layout.chunk_end)
    fast(backward.gram_grad_kernel)[(layout.num_chunks * (CHUNK_SIZE // SUB_CHUNK), num_heads)](
        q, k, beta, s["gcs"], s["dlfull"], s["dpfull"], norms, *bounds, s["dq"], s["dk"], s["dgc"], s["db"],
        scale, S=SUB_CHUNK, PREC=_bf16_dots() if q.dtype == torch.bfloat16 else DOT_PRECISION, **dims,
        num_warps=GRAM_GRAD_WARPS, maxnreg=GRAM_GRAD_REGISTERS)
    heads = _token_diag_heads(num_heads)
    fast(diagonal.diag_grad_token_kernel)[(layout.num_chunks * CHUNK_SIZE, num_heads // heads)](
        q, k, g, beta, norms, *bounds, s["dldiag"], s["dpdiag"], s["dq"], s["dk"], s["dgc"], s["db"], dq, dk,
        dbeta, scale, S=SUB_CHUNK, BH=heads, **dims, num_warps=heads)
    finish_block = min(DG_FINISH_BLOCK, key_dim)
    fast(diagonal.dg_finish_kernel)[(layout.num_chunks, num_heads, key_dim // finish_block)](
        s["dgc"], s["dgl"], *bounds, dg, H=num_heads, K=key_dim, C=CHUNK_SIZE, BK=finish_block, num_warps=4)


def _grad_scratch(q, layout, per_channel, num_key_blocks, storage):
    """fp32 buffers between the gradient kernels (the partial dq, dk and dw in storage.dtype [T, H, K]); KDA dgc, gc
    [T, H, K], dgc_last [NC, H, K], dbeta's share [T, H], dL and dP diagonal blocks [T, H, S] and whole [T, H, C];
    GDN dgc [T, H, NK + 1] (a slot per key block of state_grad_kernel, the last unwritten), dgc_last [NC, H, NK]."""
    num_tokens, num_heads, key_dim = q.shape
    f32 = dict(dtype=torch.float32, device=q.device)
    # the partial dq and dk in the storage dtype: each kernel adds its share in fp32 and rounds again, for half the
    # bytes the three kernels that read and write them move
    s = {name: buffers.empty(num_tokens, num_heads, key_dim, dtype=storage.dtype, device=q.device)
         for name in ("dq", "dk", "dw")}
    if per_channel:
        s.update({name: buffers.empty(num_tokens, num_heads, key_dim, **f32) for name in ("dgc", "gcs")})
        s["dgl"] = buffers.empty(layout.num_chunks, num_heads, key_dim, **f32)
        s["db"] = buffers.empty(num_tokens, num_heads, **f32)
        s["dldiag"], s["dpdiag"] = (buffers.empty(num_tokens, num_heads, SUB_CHUNK, **f32) for _ in range(2))
        s["dlfull"], s["dpfull"] = (buffers.empty(num_tokens, num_heads, CHUNK_SIZE, **f32) for _ in range(2))
    else:
        s["dgc"] = buffers.empty(num_tokens, num_heads, num_key_blocks + 1, **f32)
        s["dgl"] = buffers.empty(layout.num_chunks, num_heads, num_key_blocks, **f32)
        # pointers the scalar decay's kernels do not read
        s.update(dict.fromkeys(("db", "dldiag", "dpdiag", "dlfull", "dpfull", "gcs")))
    return s


class ChunkDeltaRule(torch.autograd.Function):
    """Packed inputs q, k [T, H, K], v [T, H, V], g [T, H] or [T, H, K], beta [T, H]; h0 [N, H, K, V] fp32;
    layout: the ChunkLayout of the N packed sequences; for_backward: whether grad is enabled."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, layout, scale, l2norm, for_backward):
        per_channel = g.dim() == 3
        storage = Storage.of(q.dtype)
        prep = _prep(q, k, v, g, beta, layout, scale, per_channel, l2norm, for_backward, storage)
        h, v_new, final, o = _scan(prep, q, k, h0, layout, per_channel, q.dtype, storage, for_backward)
        ctx.save_for_backward(q, k, v, g, beta, h0)
        # an unused output's gradient comes as None, not as zeros autograd would fill: no dfinal to read
        ctx.set_materialize_grads(False)
        ctx.settings = (layout, scale, l2norm, per_channel, storage)
        # intermediates, not inputs or outputs: held on ctx, freed with the graph
        ctx.kept = (prep, h, v_new)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        layout, scale, l2norm, per_channel, storage = ctx.settings
        do = torch.zeros_like(v) if do is None else do.contiguous()
        # the kernels read dfinal as a packed [N, H, K, V] array (a sum's gradient comes expanded, stride 0)
        dfinal = None if dfinal is None else dfinal.contiguous()
        prep, h, v_new = ctx.kept
        ctx.kept = None
        dh, dv_new, dh0 = _scan_bwd(prep, q, k, do, dfinal, layout, per_channel, h0 is not None, storage)
        dq, dk, dv, dg, dbeta = _input_grads(
            q, k, v, g, beta, do, prep, h, dh, v_new, dv_new, layout, scale, per_channel, l2norm, storage)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None


def gated_delta_rule(
    q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, scale=None, initial_state_BHKV=None, use_qk_l2norm=True, cu_seqlens=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_BTHV, final_state_BHKV); g_BTH log decay per head and token, or per key channel too (g_BTHK: KDA, which
    runs the per-channel kernels); packs the batch into time."""
    batch, num_tokens, num_heads, key_dim = q_BTHK.shape
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"cu_seqlens needs batch 1, got q of shape {tuple(q_BTHK.shape)}")
    # one segment is the whole sequence: the cached layout, with no count read back from the device
    layout = (_batched_layout(batch, num_tokens, CHUNK_SIZE, q_BTHK.device) if cu_seqlens is None or cu_seqlens.numel() == 2
              else ChunkLayout(cu_seqlens.to(q_BTHK.device, torch.int64), CHUNK_SIZE))
    scale = key_dim**-0.5 if scale is None else float(scale)
    packed = [t.flatten(0, 1).contiguous() for t in (q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH)]
    h0 = None if initial_state_BHKV is None else initial_state_BHKV.float().contiguous()
    # without grad no backward runs: prep then keeps nothing for one
    o, final = ChunkDeltaRule.apply(*packed, h0, layout, scale, use_qk_l2norm, torch.is_grad_enabled())
    return o.unflatten(0, (batch, num_tokens)), final
