"""Autograd function over the GDN/KDA Triton kernels: launches, buffers, the packed layout and the
KernelVariant settings under measurement (bench/bench_gated_delta.py --variants times them).

Batch is folded into time: [B, T, H, *] becomes [B*T, H, *] with B sequences given by cu_seqlens,
so one set of kernels serves the batched and the packed (varlen) case.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim, N sequences, NC chunks over all
sequences, C chunk size, X 1 (GDN) or K (KDA).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

from runtime.kernels.gated_delta import backward, diagonal, forward
from runtime.kernels.launch import fast

CHUNK_SIZE = 64
SUB_CHUNK = 16
VALUE_BLOCK = 64
# tf32 keeps the in-chunk products within ~1e-3 of fp32 and runs on tensor cores
DOT_PRECISION = "tf32"
# The chunk loops load [C, K] fp32 tiles: pipelining them (num_stages > 1) overflows shared memory
# (278 KB asked of 227 KB on the H200), so the looping kernels run with num_stages=1 (KernelVariant.scan_stages
# pipelines the scans once their tiles are bf16).


@dataclass(frozen=True)
class KernelVariant:
    """Selectable launch settings. KernelVariant() is the base the benchmark's named variants change one
    choice of; what the runtime runs is default_variant() below (the fastest measured per decay kind).
    FP32_TILES is the first path measured (GDN fwd+bwd 8.64 ms on the H200, 2026-11-29)."""

    # qg, kbar, w, u, P, v_new and dv_new stored in bf16 (computed and accumulated in fp32 all the same):
    # halves the bytes the scans and the output and gradient kernels read
    bf16_tiles: bool = True
    # the per-chunk states h and dh [NC, H, K, V] stored in bf16 (the scans carry them in fp32)
    bf16_states: bool = True
    # value block of the two scans (None: VALUE_BLOCK): smaller blocks run more programs, V / block
    # per sequence and head (32: 128 programs on the 132 SMs at H32 V128)
    scan_value_block: int | None = 32
    # software pipelining of the scans' chunk loads (1 = none; more needs bf16 tiles to fit shared memory). 1 lets
    # two programs share an SM (37-41 KB of shared memory against 139) but measured slower, with value blocks of 16
    # too: GDN 3.10 against 2.67 ms (H200, 16:47, bench/results/2026-11-29-gdn-scan-stages-1647.json)
    scan_stages: int = 2
    # warps of the two scans: with 4 the [K, V-block] fp32 state and the [C, K] tiles spill registers
    scan_warps: int = 8
    # the S x S diagonal blocks of L, (I + L)^-1 and P in diagonal.py's sub-chunk-parallel kernel, and
    # (KDA) their share of the gradients in its per-chunk kernel on [S, K] tiles
    split_diagonal: bool = True
    # keep the forward's chunk tiles, Tinv, states and v_new for the backward instead of recomputing
    # them (prep + scan again): trades about (3K + 2V + 2C) T H + NC H K V stored values per layer for time
    keep_forward: bool = True
    # the forward scan's and the output's products on bf16 operands (fp32 accumulation) when tiles and
    # states are bf16: they round h and v_new exactly as their stored copies are; else DOT_PRECISION
    bf16_dots: bool = True
    # u = Tinv beta v stored in fp32 whatever bf16_tiles says: v_new = u - w h cancels where the state
    # explains v, and u's bf16 rounding then dominates o's error (KDA at K=16: 1.05e-2 rel RMS)
    fp32_u: bool = True
    # value block of the output kernel (None: V, one program per chunk and head reads qg and P once)
    output_value_block: int | None = None
    # warps of the forward scan (None: scan_warps): one warpgroup matches its M=64 product w h, and with
    # bf16 operands and 32-bit tile offsets ptxas fits it in 244 registers without spilling (8 warps: 240)
    forward_scan_warps: int | None = 4
    # prep in forward.prep_blocked_kernel: [C, 64] column blocks, Gram products on the raw inputs scaled
    # by the l2norm afterwards, the diagonal blocks of Tinv by doubling (split_diagonal then doesn't apply
    # to the forward); GDN launches no diag_kernel, KDA one without its inverse
    blocked_prep: bool = True
    # without blocked_prep: prep_kernel inverts the diagonal blocks by doubling too (GDN then launches no
    # diag_kernel, and ptxas spills 24 B against blocked prep's 464 B; KDA's diag_kernel runs without its
    # inverse, and needs split_diagonal)
    doubling_inverse: bool = True
    # warps of prep_blocked_kernel (ptxas for sm_90a, GDN / KDA: 8 warps spill 464 / 608 B at 255
    # registers, one program per SM; 4 warps spill 1748 / 1556 B but fit two programs per SM, and measured
    # faster on the H200 at 11:28: GDN prep 0.42 against 0.63 ms, fwd+bwd 3.61 against 3.82)
    prep_warps: int = 4
    # wy_grad_kernel's products on bf16 operands, fp32 accumulation (Tinv, dTinv and dw rounded, dw's
    # scratch buffer bf16; for the scalar decay dL's Gram backward on the raw k, see common.scalar_gram_bwd):
    # 24 KB of shared memory instead of 80. The same in state_grad's dP Gram backward failed the strong
    # decay test (dg 2.3e-2 rel RMS against 1.6e-2, bar 2e-2), so it stays tf32 there
    bf16_grad_dots: bool = False
    # KDA's exact per-channel diagonal blocks token-parallel (diagonal.diag_token_kernel, and for the
    # backward diag_grad_token_kernel + dg_finish_kernel): one program per token and token_diag_heads heads
    # walking its sub-chunk's rows from memory, instead of a program per sub-chunk walking [S, K] register
    # tiles column by column (diag_kernel / diag_grad_kernel). The row-substitution inverse (without
    # doubling_inverse) stays with diag_kernel
    token_parallel_diag: bool = False
    # heads per program of the token-parallel diagonal kernels, one warp each (the reductions over K stay in
    # a warp); fewer where H is not a multiple. ptxas, K=128, forward / backward: 4 heads 48 / 93 registers,
    # 8 heads 64 / 122, no spills
    token_diag_heads: int = 4
    # KDA only: the per-channel decayed Gram backward of dL and dP (their off-diagonal S x S blocks) out of
    # state_grad_kernel and wy_grad_kernel into backward.gram_grad_kernel, one program per sub-chunk and head
    # on [S, K] tiles loaded from L2 ([S, S] x [S, K] products, only the blocks below the diagonal), instead
    # of three [C, C] x [C, BK] products per sub-chunk and key block in each (with a row-of reduction, a
    # cumsum and [C, BK] exps on every step of their chains). state_grad stores dP and gc whole, wy_grad dL
    # whole (fp32 scratch), and wy_grad's two key loops become one. Predicted and measured in backward.py's
    # docstring
    gram_grad_apart: bool = False
    # warps of gram_grad_kernel ([S, K] tiles; ptxas at K=128: 4 warps 255 registers / 32 B of spills, two
    # programs per SM; 8 warps 179 / 0 B, one per SM; 9 KB of shared memory either way)
    gram_grad_warps: int = 4
    # key block of state_grad_kernel (None: backward.KEY_BLOCK per channel, backward.STATE_KEY_BLOCK or KEY_BLOCK
    # for the scalar decay). With gram_grad_apart KDA's state_grad is GDN's plus the dgc, gc and dP stores, and
    # GDN measured 0.75 ms at 32 against 0.88 at 64; ptxas, KDA with gram_grad_apart, 8 warps: 32 240 registers
    # / 0 B of spills, 32 KB of shared memory; 64 255 / 48 B, 40 KB (without gram_grad_apart 255 / 496 B)
    state_grad_key_block: int | None = None
    # with blocked_prep: prep in two launches, prep_blocked_kernel for the Gram products, P, Tinv (stored
    # whether or not a backward follows) and the rows' inverse norms, then forward.prep_columns_kernel for kbar,
    # w, qg and u per (chunk, head, prep_column_block columns) from them: neither holds the other's tiles.
    # KDA 5.56 -> 5.25 ms fwd+bwd at 64 columns (the per-channel default); GDN 2.79 -> 2.89 (H200, 14:20)
    split_prep: bool = False
    # columns per program of prep_columns_kernel (ptxas, GDN / KDA, once it read the first launch's inverse norms
    # instead of recomputing them from q and k: 32 at 4 warps 117 / 149 registers, 64 at 8 warps 126 / 162, no
    # spills): 64 reads Tinv half as often
    prep_column_block: int = 32
    # with blocked_prep and the qk l2norm: prep stores the rows' inverse norms [T, H, 2] whenever a backward follows
    # (kept with its tiles, or recomputed with them), and the backward kernels read them instead of summing q^2 and
    # k^2 over K again: state_grad's two norm loops over all K (four [C, 64] tile loads and reductions in every
    # key-block program's chain), wy_grad's over k, finish's row reductions and, per channel, gram_grad's (every
    # sub-chunk it walks), diag_grad_token's (every row it walks) and diag_grad's. ptxas (sm_90a, pointers 16-byte
    # aligned as launched; registers, no spills either way), GDN / KDA default: state_grad 146 -> 138 / 126 -> 126,
    # wy_grad 184 -> 196 / 209 -> 209, finish 76 -> 79, gram_grad 241 -> 246 (9 -> 8 KB shared), diag_grad_token 64.
    # Predicted (H200, B1 T8192 H32 K=V=128, ms): GDN state_grad 0.80 -> 0.72-0.77 (about one L2 load round of ~13 us
    # per program), wy_grad 0.49 -> 0.47-0.49 (its norm loads already overlap the value loop's), finish unchanged
    # (bandwidth: its loads stay): fwd+bwd -0.03 to -0.1; KDA also diag_grad_token 0.83 -> 0.6-0.75 (a warp
    # reduction of 5 dependent shuffles and a sqrt off each of its ~17 walked rows' chains), gram_grad 0.78 ->
    # 0.68-0.75 (~6 reductions over K per program): fwd+bwd -0.15 to -0.35
    stored_norms: bool = False
    # scalar decay only (ignored per channel): wy_grad_kernel does finish_kernel's work, which is not launched: dq's
    # l2norm backward first (it needs nothing of wy_grad: its loads go beside Tinv's), in the tail dk's from the
    # partial the key loop just stored (re-read from L2) and dg from state_grad's dgc slots plus wy_grad's share kept
    # in registers. ptxas (as above): wy_grad 184 -> 200 registers (223 with stored_norms), no spills, 24 KB shared.
    # Predicted: finish 0.14 -> 0, wy_grad 0.49 -> 0.54-0.60 (dq's reduction and stores, one more load round in the
    # tail, 31 waves of one program per SM): GDN fwd+bwd -0.03 to -0.08
    fused_finish: bool = False
    # o = qg h + P v_new in the forward scan, per chunk and value block, from the h and v_new it holds (rounded
    # as their stored copies): no output_kernel, which re-read h and v_new (0.10 ms at B1 T8192 H32 K=V=128).
    # The scan is latency-bound (128 programs, ~2.1 us per chunk step): qg and P are prefetched with cp.async
    # as the step's other tiles (scan_stages 2), the products reuse the shared-memory copies of h and v_new
    # that w h and kbar^T v_new read, and come after the state update. ptxas (sm_90a, aligned pointers as
    # launched): 4 warps 118 -> 134 registers, 8 warps 109 -> 144, no spills; shared memory 86 -> 139 KB.
    # Predicted: one warpgroup per SM issues the step in order (each product waits for its wgmma), so the o
    # products lengthen the step rather than overlap: the step becomes backward.scan_bwd_kernel's (the same
    # five tile loads and four products, at 8 warps 0.35 ms, 2.7 us per step): scan 0.27 -> 0.33-0.35 ms,
    # output 0.10 -> 0 and one launch gap less: GDN forward 0.85 -> 0.80-0.83 ms (KDA the same ~0.03-0.05)
    # Measured (H200, 16:22): scan 0.26 -> 0.36 ms for output's 0.10; at 8 warps (144 registers) slower still,
    # GDN fwd+bwd 2.85 against 2.80 (that setting was removed)
    scan_output: bool = False


DEFAULT_VARIANT = KernelVariant()
# the path measured first (GDN fwd+bwd 8.64 ms): fp32 intermediates, in-chunk diagonals, recomputation
FP32_TILES = KernelVariant(bf16_tiles=False, bf16_states=False, scan_value_block=None, scan_stages=1, scan_warps=4,
                           split_diagonal=False, keep_forward=False, blocked_prep=False, doubling_inverse=False,
                           output_value_block=VALUE_BLOCK, forward_scan_warps=None)


def empty(*shape, dtype, device) -> torch.Tensor:
    """Every kernel-written buffer comes from here (tests swap in a NaN-filled one)."""
    return torch.empty(*shape, dtype=dtype, device=device)


class ChunkLayout:
    """Where each chunk of each packed sequence starts and ends (int32 device tensors)."""

    def __init__(self, cu_seqlens, chunk_offsets, chunk_start, chunk_end):
        self.cu_seqlens, self.chunk_offsets = cu_seqlens.to(torch.int32), chunk_offsets.to(torch.int32)
        self.chunk_start, self.chunk_end = chunk_start.to(torch.int32), chunk_end.to(torch.int32)
        self.num_seqs, self.num_chunks = len(cu_seqlens) - 1, len(chunk_start)

    @classmethod
    def packed(cls, cu_seqlens: torch.Tensor, chunk_size: int) -> "ChunkLayout":
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        chunks_per_seq = (lengths + chunk_size - 1) // chunk_size
        chunk_offsets = torch.cat([chunks_per_seq.new_zeros(1), chunks_per_seq.cumsum(0)])
        seq_of_chunk = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), chunks_per_seq)
        index_in_seq = torch.arange(len(seq_of_chunk), device=cu_seqlens.device) - chunk_offsets[seq_of_chunk]
        start = cu_seqlens[seq_of_chunk] + index_in_seq * chunk_size
        end = torch.minimum(start + chunk_size, cu_seqlens[seq_of_chunk + 1])
        return cls(cu_seqlens, chunk_offsets, start, end)

    @classmethod
    def batched(cls, batch: int, num_tokens: int, chunk_size: int, device) -> "ChunkLayout":
        """B sequences of T tokens, built without a device-to-host sync."""
        per_seq = -(-num_tokens // chunk_size)
        seq_of_chunk = torch.arange(batch * per_seq, device=device) // per_seq
        start = seq_of_chunk * num_tokens + (torch.arange(batch * per_seq, device=device) % per_seq) * chunk_size
        end = torch.minimum(start + chunk_size, (seq_of_chunk + 1) * num_tokens)
        cu_seqlens = torch.arange(batch + 1, device=device) * num_tokens
        return cls(cu_seqlens, torch.arange(batch + 1, device=device) * per_seq, start, end)


@functools.lru_cache(maxsize=32)
def _batched_layout(batch: int, num_tokens: int, chunk_size: int, device: torch.device) -> ChunkLayout:
    """The layout of B sequences of T tokens, built once per shape and chunk size: its ~15 small launches cost
    host time on every layer's forward (the kernels only read it)."""
    return ChunkLayout.batched(batch, num_tokens, chunk_size, device)


def _config():
    return dict(C=CHUNK_SIZE, S=min(SUB_CHUNK, CHUNK_SIZE), PREC=DOT_PRECISION)


def _tile_dtype(variant: KernelVariant) -> torch.dtype:
    return torch.bfloat16 if variant.bf16_tiles else torch.float32


def _state_dtype(variant: KernelVariant) -> torch.dtype:
    return torch.bfloat16 if variant.bf16_states else torch.float32


def _scan_block(variant: KernelVariant, value_dim: int) -> int:
    return min(variant.scan_value_block or VALUE_BLOCK, value_dim)


def _forward_dots(variant: KernelVariant) -> str:
    """common.mm's PREC for the forward scan and the output kernel."""
    if not (variant.bf16_dots and variant.bf16_tiles and variant.bf16_states):
        return DOT_PRECISION
    # the interpreter's bf16 tl.dot is wrong: it gets the same operand rounding with an fp32 product
    return "bf16_rounded" if os.environ.get("TRITON_INTERPRET") == "1" else "bf16"


def _token_diag_heads(num_heads: int, variant: KernelVariant) -> int:
    """Heads per program of the token-parallel diagonal kernels: the variant's token_diag_heads or the
    largest power of two below it dividing H."""
    heads = variant.token_diag_heads
    while num_heads % heads:
        heads //= 2
    return heads


def _diagonals(q, k, g, beta, layout, scale, per_channel, l2norm, inverse=True, variant=DEFAULT_VARIANT):
    """Diagonal blocks of L, (I + L)^-1 (with inverse) and P as rows [T, H, S] (fp32) from diagonal.diag_kernel,
    or (per channel, no inverse, variant.token_parallel_diag) diagonal.diag_token_kernel (no tdiag: None)."""
    num_tokens, num_heads, key_dim = q.shape
    cfg = _config()
    f32 = dict(dtype=torch.float32, device=q.device)
    if per_channel and variant.token_parallel_diag and not inverse:
        ldiag, pdiag = (empty(num_tokens, num_heads, cfg["S"], **f32) for _ in range(2))
        heads = _token_diag_heads(num_heads, variant)
        fast(diagonal.diag_token_kernel)[(layout.num_chunks * cfg["C"], num_heads // heads)](
            q, k, g, beta, layout.chunk_start, layout.chunk_end, ldiag, pdiag, scale,
            H=num_heads, K=key_dim, C=cfg["C"], S=cfg["S"], BH=heads, L2NORM=l2norm, num_warps=heads)
        return ldiag, None, pdiag
    tdiag = empty(num_tokens, num_heads, cfg["S"], **f32)
    # the scalar decay's L and P diagonals come whole from prep's Gram products: no buffers for them
    ldiag = empty(num_tokens, num_heads, cfg["S"], **f32) if per_channel else tdiag
    pdiag = empty(num_tokens, num_heads, cfg["S"], **f32) if per_channel else tdiag
    fast(diagonal.diag_kernel)[(layout.num_chunks * (cfg["C"] // cfg["S"]), num_heads)](
        q, k, g, beta, layout.chunk_start, layout.chunk_end, ldiag, tdiag, pdiag, scale,
        H=num_heads, K=key_dim, PER_CHANNEL=per_channel, L2NORM=l2norm, INVERSE=inverse, num_warps=4, **cfg)
    return ldiag, tdiag, pdiag


def _prep(q, k, v, g, beta, layout, scale, per_channel, l2norm, store_tinv, variant=DEFAULT_VARIANT):
    """Chunk-local quantities of prep_kernel, as a dict: tiles in the variant's dtype, gc_last and Tinv fp32."""
    num_tokens, num_heads, key_dim = q.shape
    cfg = _config()
    f32 = dict(dtype=torch.float32, device=q.device)
    tiles = dict(dtype=_tile_dtype(variant), device=q.device)
    out = {name: empty(num_tokens, num_heads, key_dim, **tiles) for name in ("qg", "kbar", "w")}
    out["u"] = empty(*v.shape, **(f32 if variant.fp32_u else tiles))
    out["p"] = empty(num_tokens, num_heads, cfg["C"], **tiles)
    keep_tinv = store_tinv or (variant.blocked_prep and variant.split_prep)
    out["tinv"] = empty(num_tokens, num_heads, cfg["C"], **f32) if keep_tinv else out["p"]
    out["glast"] = empty(layout.num_chunks, num_heads, key_dim if per_channel else 1, **f32)
    if variant.blocked_prep and variant.stored_norms and store_tinv and l2norm:
        # for the backward (see KernelVariant.stored_norms); its kernels read them where prep holds them
        out["norms"] = empty(num_tokens, num_heads, 2, **f32)
    if variant.blocked_prep:
        _prep_blocked(q, k, v, g, beta, layout, scale, per_channel, l2norm, store_tinv, variant, out)
        return out
    doubling = variant.doubling_inverse and (variant.split_diagonal or not per_channel)
    diags = (q, q, q)
    if variant.split_diagonal and (per_channel or not doubling):
        diags = _diagonals(q, k, g, beta, layout, scale, per_channel, l2norm, inverse=not doubling, variant=variant)
        diags = tuple(q if d is None else d for d in diags)
    fast(forward.prep_kernel)[(layout.num_chunks, num_heads)](
        q, k, v, g, beta, layout.chunk_start, layout.chunk_end,
        out["qg"], out["kbar"], out["w"], out["u"], out["p"], out["glast"], out["tinv"], *diags, scale,
        H=num_heads, K=key_dim, V=v.shape[-1], PER_CHANNEL=per_channel, L2NORM=l2norm,
        STORE_TINV=store_tinv, SPLIT_DIAG=variant.split_diagonal and (per_channel or not doubling),
        DOUBLING=doubling, num_warps=8, **cfg)
    return out


def _prep_blocked(q, k, v, g, beta, layout, scale, per_channel, l2norm, store_tinv, variant, out):
    """prep in forward.prep_blocked_kernel, writing the buffers of out."""
    num_heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[-1]
    cfg = _config()
    diags = (q, q)
    if per_channel:
        ldiag, _, pdiag = _diagonals(q, k, g, beta, layout, scale, per_channel, l2norm, inverse=False,
                                     variant=variant)
        diags = (ldiag, pdiag)
    # bf16 operands are exact for bf16 inputs; the interpreter gets the same rounding in fp32 (see common.mm)
    block = min(64, key_dim, value_dim)
    # k's and q's inverse norms per token [T, H, 2]: for the backward (out["norms"]) or, with split_prep, from the
    # first launch to the second
    inverse_norms = out.get("norms", out["glast"])
    if variant.split_prep and "norms" not in out:
        inverse_norms = empty(q.shape[0], num_heads, 2, dtype=torch.float32, device=q.device)
    gram = DOT_PRECISION
    if q.dtype == torch.bfloat16:
        gram = "bf16_rounded" if os.environ.get("TRITON_INTERPRET") == "1" else "bf16"
    fast(forward.prep_blocked_kernel)[(layout.num_chunks, num_heads)](
        q, k, v, g, beta, layout.chunk_start, layout.chunk_end,
        out["qg"], out["kbar"], out["w"], out["u"], out["p"], out["glast"], out["tinv"], inverse_norms, *diags,
        scale, H=num_heads, K=key_dim, V=value_dim, BD=block, PER_CHANNEL=per_channel,
        L2NORM=l2norm, STORE_TINV=store_tinv or variant.split_prep,
        COLUMNS=not variant.split_prep, STORE_NORMS=variant.split_prep or "norms" in out, GRAM_PREC=gram,
        DIAG_PREC="tf32x3",
        num_warps=variant.prep_warps, **cfg)
    if variant.split_prep:
        columns = min(variant.prep_column_block, key_dim, value_dim)
        fast(forward.prep_columns_kernel)[(layout.num_chunks, num_heads, key_dim // columns + value_dim // columns)](
            q, k, v, g, beta, layout.chunk_start, layout.chunk_end, out["tinv"], inverse_norms, out["qg"],
            out["kbar"], out["w"], out["u"], out["glast"], H=num_heads, K=key_dim, V=value_dim, C=cfg["C"],
            BD=columns, PER_CHANNEL=per_channel, PREC=cfg["PREC"], num_warps=4 if columns <= 32 else 8)


def _scan(prep, h0, layout, per_channel, store_final, variant=DEFAULT_VARIANT, out_dtype=None):
    """(h of every chunk [NC, H, K, V], v_new [T, H, V], final state [N, H, K, V] fp32 or None, o [T, H, V] in
    out_dtype or None): with out_dtype the scan writes o too (KernelVariant.scan_output)."""
    num_tokens, num_heads, key_dim = prep["w"].shape
    value_dim = prep["u"].shape[-1]
    device = prep["w"].device
    h = empty(layout.num_chunks, num_heads, key_dim, value_dim, dtype=_state_dtype(variant), device=device)
    v_new = empty(num_tokens, num_heads, value_dim, dtype=_tile_dtype(variant), device=device)
    final = h
    if store_final:
        final = empty(layout.num_seqs, num_heads, key_dim, value_dim, dtype=torch.float32, device=device)
    # without out_dtype o_ptr is a pointer argument only
    o = v_new if out_dtype is None else empty(num_tokens, num_heads, value_dim, dtype=out_dtype, device=device)
    warps = variant.forward_scan_warps or variant.scan_warps
    block = _scan_block(variant, value_dim)
    fast(forward.scan_kernel)[(layout.num_seqs, num_heads, value_dim // block)](
        prep["w"], prep["u"], prep["kbar"], prep["glast"], h0 if h0 is not None else final, prep["qg"], prep["p"],
        layout.cu_seqlens, layout.chunk_offsets, h, v_new, final, o,
        H=num_heads, K=key_dim, V=value_dim, C=CHUNK_SIZE, BV=block, PER_CHANNEL=per_channel,
        HAS_H0=h0 is not None, STORE_FINAL=store_final, OUTPUT=out_dtype is not None, PREC=_forward_dots(variant),
        num_warps=warps, num_stages=variant.scan_stages)
    return h, v_new, final if store_final else None, None if out_dtype is None else o


def _output(prep, h, v_new, layout, out_dtype, variant=DEFAULT_VARIANT):
    num_tokens, num_heads, key_dim = prep["qg"].shape
    value_dim = v_new.shape[-1]
    o = empty(num_tokens, num_heads, value_dim, dtype=out_dtype, device=v_new.device)
    block = min(variant.output_value_block or value_dim, value_dim)
    fast(forward.output_kernel)[(layout.num_chunks, num_heads, value_dim // block)](
        prep["qg"], prep["p"], h, v_new, layout.chunk_start, layout.chunk_end, o,
        H=num_heads, K=key_dim, V=value_dim, C=CHUNK_SIZE, BV=block, PREC=_forward_dots(variant), num_warps=4)
    return o


def _scan_bwd(prep, do, dht, layout, per_channel, want_dh0, variant=DEFAULT_VARIANT):
    """(dh leaving every chunk [NC, H, K, V], dv_new [T, H, V], dh0 [N, H, K, V] fp32 or None)."""
    num_tokens, num_heads, key_dim = prep["w"].shape
    value_dim = do.shape[-1]
    device = do.device
    dh = empty(layout.num_chunks, num_heads, key_dim, value_dim, dtype=_state_dtype(variant), device=device)
    dv_new = empty(num_tokens, num_heads, value_dim, dtype=_tile_dtype(variant), device=device)
    dh0 = empty(layout.num_seqs, num_heads, key_dim, value_dim, dtype=torch.float32, device=device) if want_dh0 else dh
    block = _scan_block(variant, value_dim)
    fast(backward.scan_bwd_kernel)[(layout.num_seqs, num_heads, value_dim // block)](
        do, prep["p"], prep["kbar"], prep["qg"], prep["w"], prep["glast"], dht if dht is not None else dh0,
        layout.cu_seqlens, layout.chunk_offsets, dh, dv_new, dh0,
        H=num_heads, K=key_dim, V=value_dim, C=CHUNK_SIZE, BV=block, PER_CHANNEL=per_channel,
        HAS_DHT=dht is not None, STORE_DH0=want_dh0, DOTS=_forward_dots(variant), num_warps=variant.scan_warps,
        num_stages=variant.scan_stages)
    return dh, dv_new, dh0 if want_dh0 else None


def _input_grads(q, k, v, g, beta, do, prep, h, dh, v_new, dv_new, layout, scale, per_channel, l2norm,
                 variant=DEFAULT_VARIANT):
    """(dq, dk, dv, dg, dbeta) in the inputs' dtypes: backward.py's state_grad_kernel, wy_grad_kernel,
    then finish_kernel (scalar decay; with fused_finish wy_grad_kernel does its work) or diagonal.diag_grad_kernel
    (per channel, whatever the variant's forward did with the diagonal blocks: the exact per-channel blocks need
    [S, K] tiles; with token_parallel_diag diagonal.diag_grad_token_kernel and dg_finish_kernel instead). Per
    channel with gram_grad_apart, backward.gram_grad_kernel runs between wy_grad_kernel and the diagonal kernels.
    Where prep holds the rows' inverse norms (stored_norms), every kernel reads them instead of recomputing."""
    num_tokens, num_heads, key_dim = q.shape
    value_dim = v.shape[-1]
    cfg = _config()
    dq, dk, dv, dg, dbeta = [empty(*t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v, g, beta)]
    blocks = dict(BK=min(backward.KEY_BLOCK, key_dim), BV=min(VALUE_BLOCK, value_dim))
    state_key_block = backward.KEY_BLOCK if per_channel else backward.STATE_KEY_BLOCK or backward.KEY_BLOCK
    state_key_block = variant.state_grad_key_block or state_key_block
    state_blocks = dict(blocks, BK=min(state_key_block, key_dim))
    # state_grad_kernel's key blocks: the slots of dgc and dgl it writes
    num_key_blocks = key_dim // state_blocks["BK"]
    s = _grad_scratch(q, layout, per_channel, num_key_blocks, cfg, variant)
    dims = dict(H=num_heads, K=key_dim, C=cfg["C"], L2NORM=l2norm)
    bounds = (layout.chunk_start, layout.chunk_end)
    gram_apart = per_channel and variant.gram_grad_apart
    fused_finish = variant.fused_finish and not per_channel
    stored = "norms" in prep
    # (a pointer argument only without them)
    norms = prep.get("norms", s["dq"])
    fast(backward.state_grad_kernel)[(layout.num_chunks * num_key_blocks, num_heads)](
        q, k, g, h, dh, v_new, dv_new, do, *bounds, norms, s["dq"], s["dk"], s["dw"], s["dgc"], s["dgl"],
        s["dpdiag"], s["dpfull"], s["gcs"], scale, V=value_dim, S=cfg["S"], PER_CHANNEL=per_channel,
        PREC=cfg["PREC"], DOTS=_forward_dots(variant), GRAM_APART=gram_apart, STORED_NORMS=stored, **state_blocks,
        **dims, num_warps=backward.STATE_GRAD_WARPS, num_stages=backward.STATE_GRAD_STAGES,
        maxnreg=backward.STATE_GRAD_MAXNREG)
    fast(backward.wy_grad_kernel)[(layout.num_chunks, num_heads)](
        q, k, v, g, beta, prep["tinv"], dv_new, s["dw"], norms, *bounds, dv, s["dk"], s["dgc"],
        s["db"] if per_channel else dbeta, s["dldiag"], s["dlfull"], s["gcs"], s["dq"], s["dgl"], dq, dk, dg, scale,
        V=value_dim, S=cfg["S"], PER_CHANNEL=per_channel, PREC=cfg["PREC"], GRAD_DOTS=_grad_dots(variant),
        SLOT=num_key_blocks, GRAM_APART=gram_apart, STORED_NORMS=stored, FUSED_FINISH=fused_finish, **blocks,
        **dims, num_warps=backward.WY_GRAD_WARPS, num_stages=backward.WY_GRAD_STAGES,
        maxnreg=backward.WY_GRAD_MAXNREG)
    if gram_apart:
        fast(backward.gram_grad_kernel)[(layout.num_chunks * (cfg["C"] // cfg["S"]), num_heads)](
            q, k, beta, s["gcs"], s["dlfull"], s["dpfull"], norms, *bounds, s["dq"], s["dk"], s["dgc"], s["db"],
            scale, S=cfg["S"], PREC=cfg["PREC"], STORED_NORMS=stored, **dims, num_warps=variant.gram_grad_warps)
    if per_channel and variant.token_parallel_diag:
        heads = _token_diag_heads(num_heads, variant)
        fast(diagonal.diag_grad_token_kernel)[(layout.num_chunks * cfg["C"], num_heads // heads)](
            q, k, g, beta, norms, *bounds, s["dldiag"], s["dpdiag"], s["dq"], s["dk"], s["dgc"], s["db"], dq, dk,
            dbeta, scale, S=cfg["S"], BH=heads, STORED_NORMS=stored, **dims, num_warps=heads)
        finish_block = min(32, key_dim)
        fast(diagonal.dg_finish_kernel)[(layout.num_chunks, num_heads, key_dim // finish_block)](
            s["dgc"], s["dgl"], *bounds, dg, H=num_heads, K=key_dim, C=cfg["C"], BK=finish_block, num_warps=4)
    elif per_channel:
        fast(diagonal.diag_grad_kernel)[(layout.num_chunks, num_heads)](
            q, k, g, beta, norms, *bounds, s["dldiag"], s["dpdiag"], s["dq"], s["dk"], s["dgc"], s["db"], s["dgl"],
            dq, dk, dg, dbeta, scale, S=cfg["S"], STORED_NORMS=stored, **dims, num_warps=4)
    elif not fused_finish:
        fast(backward.finish_kernel)[(layout.num_chunks, num_heads)](
            q, k, norms, s["dq"], s["dk"], s["dgc"], s["dgl"], *bounds, dq, dk, dg, scale, NK=num_key_blocks,
            STORED_NORMS=stored, **dims, num_warps=backward.FINISH_WARPS)
    return dq, dk, dv, dg, dbeta


def _grad_dots(variant: KernelVariant) -> str:
    """common.mm's PREC for wy_grad_kernel's products."""
    if not variant.bf16_grad_dots:
        return DOT_PRECISION
    return "bf16_rounded" if os.environ.get("TRITON_INTERPRET") == "1" else "bf16"


def _grad_scratch(q, layout, per_channel, num_key_blocks, cfg, variant=DEFAULT_VARIANT):
    """fp32 buffers between the gradient kernels (dw bf16 with bf16_grad_dots): dq, dk, dw [T, H, K]; dgc
    [T, H, K] per channel, else [T, H, NK + 1] (a slot per K block of state_grad_kernel and one for
    wy_grad_kernel, unwritten with fused_finish); dgc_last [NC, H, K], else [NC, H, NK]; per channel also dbeta's
    share [T, H] and dL, dP diagonal blocks [T, H, S], and with gram_grad_apart dL, dP whole [T, H, C] and gc
    [T, H, K]."""
    num_tokens, num_heads, key_dim = q.shape
    sub_chunk = cfg["S"]
    f32 = dict(dtype=torch.float32, device=q.device)
    s = {name: empty(num_tokens, num_heads, key_dim, **f32) for name in ("dq", "dk")}
    s["dw"] = empty(num_tokens, num_heads, key_dim, dtype=torch.bfloat16 if variant.bf16_grad_dots else torch.float32,
                    device=q.device)
    if per_channel:
        s["dgc"] = empty(num_tokens, num_heads, key_dim, **f32)
        s["dgl"] = empty(layout.num_chunks, num_heads, key_dim, **f32)
        s["db"] = empty(num_tokens, num_heads, **f32)
        s["dldiag"], s["dpdiag"] = (empty(num_tokens, num_heads, sub_chunk, **f32) for _ in range(2))
    if per_channel and variant.gram_grad_apart:
        s["dlfull"], s["dpfull"] = (empty(num_tokens, num_heads, cfg["C"], **f32) for _ in range(2))
        s["gcs"] = empty(num_tokens, num_heads, key_dim, **f32)
    elif per_channel:
        # unused without gram_grad_apart (pointer arguments only)
        s["dlfull"] = s["dpfull"] = s["gcs"] = s["dgl"]
    else:
        s["dgc"] = empty(num_tokens, num_heads, num_key_blocks + 1, **f32)
        s["dgl"] = empty(layout.num_chunks, num_heads, num_key_blocks, **f32)
        # unused by the scalar decay's kernels (their pointer arguments only)
        s["db"] = s["dldiag"] = s["dpdiag"] = s["dlfull"] = s["dpfull"] = s["gcs"] = s["dgl"]
    return s


class ChunkDeltaRule(torch.autograd.Function):
    """Packed inputs q, k [T, H, K], v [T, H, V], g [T, H] or [T, H, K], beta [T, H]; h0 [N, H, K, V] fp32;
    layout: the ChunkLayout of the N packed sequences; variant: a KernelVariant."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, layout, scale, l2norm, variant):
        per_channel = g.dim() == 3
        prep = _prep(q, k, v, g, beta, layout, scale, per_channel, l2norm, variant.keep_forward, variant)
        h, v_new, final, o = _scan(prep, h0, layout, per_channel, True, variant,
                                   q.dtype if variant.scan_output else None)
        if o is None:
            o = _output(prep, h, v_new, layout, q.dtype, variant)
        ctx.save_for_backward(q, k, v, g, beta, h0)
        # an unused output's gradient comes as None, not as zeros autograd would fill: no dfinal to read
        ctx.set_materialize_grads(False)
        ctx.settings = (layout, scale, l2norm, per_channel, variant)
        # intermediates, not inputs or outputs: held on ctx, freed with the graph
        ctx.kept = (prep, h, v_new) if variant.keep_forward else None
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        layout, scale, l2norm, per_channel, variant = ctx.settings
        do = torch.zeros_like(v) if do is None else do.contiguous()
        if ctx.kept is None:
            prep = _prep(q, k, v, g, beta, layout, scale, per_channel, l2norm, True, variant)
            h, v_new, _, _ = _scan(prep, h0, layout, per_channel, False, variant)
        else:
            prep, h, v_new = ctx.kept
            ctx.kept = None
        dh, dv_new, dh0 = _scan_bwd(prep, do, dfinal, layout, per_channel, h0 is not None, variant)
        dq, dk, dv, dg, dbeta = _input_grads(
            q, k, v, g, beta, do, prep, h, dh, v_new, dv_new, layout, scale, per_channel, l2norm, variant)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None


# The fastest settings measured per decay kind (H200, 2026-11-29, bench/bench_gated_delta.py --variants):
# - GDN "bf16_grads" 3.43 ms fwd+bwd at 12:00 (KernelVariant() 3.87,
#   bench/results/2026-11-29-gdn-kda-variants-final.json).
# - KDA "kda_gram_apart_bf16_skb32" 6.20 ms at 13:40 against "token_diag_unblocked" (the default until then) 7.47
#   in the same run (bench/results/2026-11-29-kda-gram-apart.json); then with prep in two launches, 64 columns per
#   program of the second ("kda_split_prep_ga_c64"): 5.25 ms against 5.56 for the settings before, 14:20 run
#   (bench/results/2026-11-29-gdn-kda-variants-1420.json).
# - 16:22 run (bench/results/2026-11-29-gdn-kda-variants-1622.json): GDN with stored norms, finish in wy_grad, o in
#   the forward scan and state_grad key block 32 (then named "gdn_all_skb32") 2.72 ms against 2.79 for the settings
#   before (kernel sums 2.49 / 2.55; each flag alone within +-0.05 of the default); KDA with stored norms and o in
#   the scan ("kda_norms_scan_output") 5.12 against 5.27 (diag_grad_token 0.80 -> 0.61 with the stored norms).
SCALAR_DECAY_DEFAULT = KernelVariant(bf16_grad_dots=True, stored_norms=True, fused_finish=True, scan_output=True,
                                     state_grad_key_block=32)
PER_CHANNEL_DECAY_DEFAULT = KernelVariant(token_parallel_diag=True, split_prep=True, gram_grad_apart=True,
                                          bf16_grad_dots=True, state_grad_key_block=32, prep_column_block=64,
                                          stored_norms=True, scan_output=True)


@functools.lru_cache(maxsize=64)
def _without_backward(variant: KernelVariant) -> KernelVariant:
    """variant with keep_forward off (cached: dataclasses.replace is host time on every no-grad layer call)."""
    return replace(variant, keep_forward=False)


@functools.lru_cache(maxsize=8)
def default_variant(per_channel: bool, dtype: torch.dtype) -> KernelVariant:
    """The measured fastest settings for the decay kind. fp32 inputs keep fp32 intermediates: bf16 storage
    holds an fp32 run to bf16 precision (on the H200 an fp32 tier-0 check of GDN's dg reached 5.5e-3 rel RMS
    with bf16 tiles, against the TF32 bound of 5e-3)."""
    chosen = PER_CHANNEL_DECAY_DEFAULT if per_channel else SCALAR_DECAY_DEFAULT
    if dtype == torch.float32:
        chosen = replace(chosen, bf16_tiles=False, bf16_states=False, bf16_grad_dots=False)
    return chosen


def chunk_delta_rule(q_BTHK, k_BTHK, v_BTHV, g, beta_BTH, scale, initial_state_BHKV, use_qk_l2norm, cu_seqlens,
                     variant=None):
    """Shared entry of gated_delta_rule and kda: checks, packs the batch into time, unpacks the output."""
    batch, num_tokens, num_heads, key_dim = q_BTHK.shape
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"cu_seqlens needs batch 1, got q of shape {tuple(q_BTHK.shape)}")
    if cu_seqlens is None:
        layout = _batched_layout(batch, num_tokens, CHUNK_SIZE, q_BTHK.device)
    else:
        layout = ChunkLayout.packed(cu_seqlens.to(q_BTHK.device, torch.int64), CHUNK_SIZE)
    scale = key_dim**-0.5 if scale is None else float(scale)
    packed = [t.flatten(0, 1).contiguous() for t in (q_BTHK, k_BTHK, v_BTHV, g, beta_BTH)]
    h0 = None if initial_state_BHKV is None else initial_state_BHKV.float().contiguous()
    variant = variant or default_variant(g.dim() == 4, q_BTHK.dtype)
    if variant.keep_forward and not torch.is_grad_enabled():
        # no backward will run: skip storing Tinv for it
        variant = _without_backward(variant)
    o, final = ChunkDeltaRule.apply(*packed, h0, layout, scale, use_qk_l2norm, variant)
    return o.unflatten(0, (batch, num_tokens)), final
