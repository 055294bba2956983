"""Sparse MLA attention (DSA) in Triton: forward with online softmax, backward for dq and dkv.

Shape legend: B batch, T tokens, H heads, K = V + R key width, V value (latent) width, R tail
(rope) width, S selected keys; in-kernel tiles: BH heads, BS selected keys, BV / BR padded widths, BC value
and BCR rope columns.

One program handles one query token and a block of BH heads: all heads of a token share the
same selected kv rows, so a gathered [BS, K] tile feeds a [BH, BS] score tile. Keys are visited
in tiles of BS indices; index -1 masks a slot. The forward saves the base-2 log-sum-exp. The backward
runs three passes per chunk of tokens: the scores pass recomputes the probabilities p and stores p and
scale * ds of the chunk; the dq pass, one program per (token, BH heads, BC of the K columns), is the product
(scale * ds) [BH, S] x the selected kv rows [S, BC]; the dkv pass, one program per (token, BS index slots, BC
columns), reduces over all the token's heads on tensor cores, (scale * ds)^T q + p^T dO for value columns and
(scale * ds)^T q for the rope tail, and scatter-adds that [BS, BC] block of dkv rows into an fp32 buffer with
atomics (several tokens select the same key row). Apart, each pass runs its products on warpgroup tiles: with
dq accumulated in the scores pass, its [heads, 576] fp32 accumulator held that pass to 16 heads a program.
On Hopper, for bf16 shapes its tiles take, the forward and the dkv pass run as gluon/sparse_attention.py's Gluon
kernels (the same contracts); these Triton kernels run everywhere else, and under the CPU interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.common import buffers
from runtime.ops.common.launch import fast
from runtime.ops.dsa.gluon import sparse_attention as gluon_attention

LOG2E = 1.4426950408889634
# Heads per program (BH) and selected keys per step (BS): all heads of a token share its gathered
# kv rows, so more heads per program means fewer gathers.
FWD_HEADS, FWD_KEYS = 64, 64
# The backward's scores pass: p and ds of SCORE_HEADS heads, holding their q and dO. 64 heads is one warpgroup
# tile; 32 keys a step leave shared memory for 3 stages (64 keys: 1 stage fits, and that is slower).
SCORE_HEADS, SCORE_KEYS, SCORE_WARPS, SCORE_STAGES = 64, 32, 4, 3
# The dq pass: DQ_HEADS heads x DQ_COLUMNS of the K columns per program, the token's selected rows walked
# DQ_KEYS at a time as the product's reduction (the fastest of the configs tried).
DQ_HEADS, DQ_KEYS, DQ_COLUMNS, DQ_WARPS, DQ_STAGES = 128, 64, 128, 8, 5
# The dkv pass: DKV_KEYS selected rows of one token and DKV_COLUMNS of their K columns per program, the token's
# heads walked DKV_HEADS at a time as the products' reduction. Programs over all 576 columns fit only 32 rows
# (64 rows do not fit their [64, 512] fp32 accumulator in registers) and each re-reads the token's whole q and dO.
# In column blocks a token's programs read p and ds once per column block and q and dO once per slot block:
# 64 rows x 128 columns at 4 warps with 32 heads a step and 3 stages was the fastest of the blockings tried
# (64 heads a step, 128 x 64 and 128 x 32 at 8 warps were slower).
DKV_HEADS, DKV_KEYS, DKV_COLUMNS, DKV_WARPS, DKV_STAGES = 32, 64, 128, 4, 3
# Tokens per backward chunk: p and ds of a chunk are two [chunk, H, S] buffers in q's dtype (2.1 GB at 128
# heads and 2048 keys in bf16; onboard/gap/budget.py counts them)
BWD_CHUNK_TOKENS = 2048
# the forward's warps and pipeline stages: the fastest of those tried
NUM_WARPS, NUM_STAGES = 8, 2


@triton.jit
def _load_selected(kv_ptr, idx_ptr, tok, T, S, s0, V, R, K, BS: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr):
    """Gather the kv rows of index slots s0..s0+BS-1 of token `tok` (of the B * T): (valid_BS, rows_BS,
    kv_v_BSxBV, kv_r_BSxBR)."""
    offs_s = s0 + tl.arange(0, BS)
    idx = tl.load(idx_ptr + tok * S + offs_s, mask=offs_s < S, other=-1)
    valid = idx >= 0
    rows = ((tok // T) * T + tl.where(valid, idx, 0)).to(tl.int64)
    offs_v, offs_r = tl.arange(0, BV), tl.arange(0, BR)
    kv_v = tl.load(kv_ptr + rows[:, None] * K + offs_v[None, :], mask=valid[:, None] & (offs_v[None, :] < V), other=0.0)
    kv_r = tl.load(kv_ptr + rows[:, None] * K + V + offs_r[None, :], mask=valid[:, None] & (offs_r[None, :] < R), other=0.0)
    return valid, rows, kv_v, kv_r


@triton.jit
def _load_heads(ptr, tok, h0, H, width, row_width, col0, BH: tl.constexpr, BW: tl.constexpr):
    """Rows h0..h0+BH-1 of token `tok` of a [tokens, H, row_width] tensor, columns col0.. +width."""
    offs_h, offs_w = h0 + tl.arange(0, BH), tl.arange(0, BW)
    ptrs = ptr + (tok * H + offs_h[:, None]) * row_width + col0 + offs_w[None, :]
    return tl.load(ptrs, mask=(offs_h[:, None] < H) & (offs_w[None, :] < width), other=0.0)


@triton.jit
def _token_and_head0(H, BH: tl.constexpr):
    """(token, first head) of this program on the 1-D grid. A token's head blocks are neighbours in
    launch order, so they run together and gather the same kv rows (and add into the same dkv rows)
    through L2."""
    head_blocks = tl.cdiv(H, BH)
    pid = tl.program_id(0).to(tl.int64)
    return pid // head_blocks, (pid % head_blocks).to(tl.int32) * BH


@triton.jit
def _fwd_kernel(q_ptr, kv_ptr, idx_ptr, o_ptr, lse_ptr, scale_log2, T, H, S, V, R,
                BH: tl.constexpr, BS: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr):
    tok, h0 = _token_and_head0(H, BH)
    K = V + R
    q_v = _load_heads(q_ptr, tok, h0, H, V, K, 0, BH, BV)
    q_r = _load_heads(q_ptr, tok, h0, H, R, K, V, BH, BR)
    m = tl.full([BH], float("-inf"), tl.float32)
    l = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BV], tl.float32)
    for s0 in range(0, S, BS):
        valid, rows, kv_v, kv_r = _load_selected(kv_ptr, idx_ptr, tok, T, S, s0, V, R, K, BS, BV, BR)
        logits = tl.dot(q_v, tl.trans(kv_v)) + tl.dot(q_r, tl.trans(kv_r))
        logits = tl.where(valid[None, :], logits * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, 1))
        # while no valid key has been seen m_new is -inf; shift by 0 to keep exp2 finite
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(logits - shift[:, None])
        alpha = tl.exp2(m - shift)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv_v.dtype), kv_v)
        m = m_new
    has_keys = l > 0
    o = acc / tl.where(has_keys, l, 1.0)[:, None]
    offs_h, offs_v = h0 + tl.arange(0, BH), tl.arange(0, BV)
    o_ptrs = o_ptr + (tok * H + offs_h[:, None]) * V + offs_v[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=(offs_h[:, None] < H) & (offs_v[None, :] < V))
    lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l, 1.0)), float("inf"))
    tl.store(lse_ptr + tok * H + offs_h, lse, mask=offs_h < H)


@triton.jit
def _bwd_scores_kernel(q_ptr, kv_ptr, idx_ptr, o_ptr, do_ptr, lse_ptr, p_ptr, ds_ptr,
                       scale, scale_log2, tok0, T, H, S, V, R,
                       BH: tl.constexpr, BS: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr):
    """p and scale * ds of BH heads of one token, stored [chunk token, H, S] for the dq and dkv passes."""
    tok, h0 = _token_and_head0(H, BH)
    tok += tok0
    K = V + R
    offs_h = h0 + tl.arange(0, BH)
    head_ok = offs_h < H
    q_v = _load_heads(q_ptr, tok, h0, H, V, K, 0, BH, BV)
    q_r = _load_heads(q_ptr, tok, h0, H, R, K, V, BH, BR)
    do = _load_heads(do_ptr, tok, h0, H, V, V, 0, BH, BV)
    # lse is +inf for heads without keys (and padding heads): their p is exp2(-inf) = 0
    lse = tl.load(lse_ptr + tok * H + offs_h, mask=head_ok, other=float("inf"))
    # softmax backward's row term sum_v o * dO, here rather than as torch passes over fp32 copies of o and dO
    delta = tl.sum(_load_heads(o_ptr, tok, h0, H, V, V, 0, BH, BV).to(tl.float32) * do.to(tl.float32), 1)
    saved = ((tok - tok0) * H + offs_h[:, None]) * S
    for s0 in range(0, S, BS):
        valid, rows, kv_v, kv_r = _load_selected(kv_ptr, idx_ptr, tok, T, S, s0, V, R, K, BS, BV, BR)
        logits = tl.dot(q_v, tl.trans(kv_v)) + tl.dot(q_r, tl.trans(kv_r))
        p = tl.where(valid[None, :], tl.exp2(logits * scale_log2 - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(kv_v))
        # the gradient w.r.t. the unscaled logits: the scale of the logits folded in
        ds = p * (dp - delta[:, None]) * scale
        offs_s = s0 + tl.arange(0, BS)
        at = saved + offs_s[None, :]
        keep = head_ok[:, None] & (offs_s < S)[None, :]
        tl.store(p_ptr + at, p.to(p_ptr.dtype.element_ty), mask=keep)
        tl.store(ds_ptr + at, ds.to(ds_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _column_block(block, V, R, BC: tl.constexpr, BCR: tl.constexpr):
    """(first column, width) of column block `block` of a K = V + R row: cdiv(V, BC) value blocks of BC columns,
    then cdiv(R, BCR) rope blocks of BCR, so that no block straddles the two."""
    num_value_blocks = tl.cdiv(V, BC)
    is_value = block < num_value_blocks
    col0 = tl.where(is_value, block * BC, V + (block - num_value_blocks) * BCR)
    return col0, tl.where(is_value, V, V + R) - col0


@triton.jit
def _selected_rows(idx_ptr, tok, T, S, offs_s):
    """(valid, kv row) of index slots offs_s of token `tok` (of the B * T)."""
    idx = tl.load(idx_ptr + tok * S + offs_s, mask=offs_s < S, other=-1)
    valid = idx >= 0
    return valid, ((tok // T) * T + tl.where(valid, idx, 0)).to(tl.int64)


@triton.jit
def _dq_columns(kv_ptr, idx_ptr, ds_ptr, dq_ptr, tok, tok0, T, H, S, K, h0, col0, width,
                BH: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr):
    offs_h, offs_c = h0 + tl.arange(0, BH), tl.arange(0, BC)
    head_ok, col_ok = offs_h < H, offs_c < width
    acc = tl.zeros([BH, BC], tl.float32)
    for s0 in range(0, S, BS):
        offs_s = s0 + tl.arange(0, BS)
        valid, rows = _selected_rows(idx_ptr, tok, T, S, offs_s)
        # the scores pass stored 0 for masked slots; slots past S are not in the buffer
        ds = tl.load(ds_ptr + ((tok - tok0) * H + offs_h[:, None]) * S + offs_s[None, :],
                     mask=head_ok[:, None] & (offs_s < S)[None, :], other=0.0)
        kv = tl.load(kv_ptr + rows[:, None] * K + col0 + offs_c[None, :], mask=valid[:, None] & col_ok[None, :],
                     other=0.0)
        acc = tl.dot(ds, kv.to(ds.dtype), acc)
    tl.store(dq_ptr + (tok * H + offs_h[:, None]) * K + col0 + offs_c[None, :], acc.to(dq_ptr.dtype.element_ty),
             mask=head_ok[:, None] & col_ok[None, :])


@triton.jit
def _bwd_dq_kernel(kv_ptr, idx_ptr, ds_ptr, dq_ptr, tok0, T, H, S, V, R,
                   BH: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr, BCR: tl.constexpr):
    """One column block (BC value or BCR rope columns) of dq of BH heads of one token: (scale * ds) [BH, S] x the
    selected kv rows [S, columns], the slots the reduction. A token's programs are neighbours on the 1-D grid,
    the column blocks of one head block innermost, so they read the same ds rows through L2."""
    num_head_blocks = tl.cdiv(H, BH)
    num_col_blocks = tl.cdiv(V, BC) + tl.cdiv(R, BCR)
    pid = tl.program_id(0).to(tl.int64)
    tok = tok0 + pid // (num_head_blocks * num_col_blocks)
    h0 = (pid // num_col_blocks % num_head_blocks).to(tl.int32) * BH
    col0, width = _column_block((pid % num_col_blocks).to(tl.int32), V, R, BC, BCR)
    # the rope tail's narrower block in a branch: a launch of its own would read the chunk's ds from HBM again
    if col0 < V:
        _dq_columns(kv_ptr, idx_ptr, ds_ptr, dq_ptr, tok, tok0, T, H, S, V + R, h0, col0, width, BH, BS, BC)
    else:
        _dq_columns(kv_ptr, idx_ptr, ds_ptr, dq_ptr, tok, tok0, T, H, S, V + R, h0, col0, width, BH, BS, BCR)


@triton.jit
def _bwd_dkv_kernel(q_ptr, idx_ptr, do_ptr, p_ptr, ds_ptr, dkv_ptr, tok0, T, H, S, V, R,
                    BH: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr, ROPE: tl.constexpr):
    """One block of BC value columns (or, with ROPE, rope columns) of the dkv of the BS selected rows of one
    token's index slots s0.. : the sum over all heads of (scale * ds)^T q, plus p^T dO for value columns, as
    [BS, heads] x [heads, BC] products (the heads are the reduction), added into the fp32 dkv rows with atomics
    (several tokens select the same row). A token's programs are neighbours on the 1-D grid, the column blocks of
    one slot block innermost, so they read the same p, ds, q and dO through L2."""
    num_slot_blocks = tl.cdiv(S, BS)
    num_col_blocks = tl.cdiv(R if ROPE else V, BC)
    pid = tl.program_id(0).to(tl.int64)
    tok = tok0 + pid // (num_slot_blocks * num_col_blocks)
    s0 = (pid // num_col_blocks % num_slot_blocks).to(tl.int32) * BS
    col0 = (V if ROPE else 0) + (pid % num_col_blocks).to(tl.int32) * BC
    K = V + R
    width = (K if ROPE else V) - col0
    offs_s = s0 + tl.arange(0, BS)
    valid, rows = _selected_rows(idx_ptr, tok, T, S, offs_s)
    acc = tl.zeros([BS, BC], tl.float32)
    for h0 in range(0, H, BH):
        offs_h = h0 + tl.arange(0, BH)
        at = ((tok - tok0) * H + offs_h[:, None]) * S + offs_s[None, :]
        keep = (offs_h < H)[:, None] & valid[None, :]
        # every load of the step before its products (faster than each product after its own loads)
        if not ROPE:
            p = tl.load(p_ptr + at, mask=keep, other=0.0)
        ds = tl.load(ds_ptr + at, mask=keep, other=0.0)
        q = _load_heads(q_ptr, tok, h0, H, width, K, col0, BH, BC)
        if not ROPE:
            do = _load_heads(do_ptr, tok, h0, H, width, V, col0, BH, BC)
        acc = tl.dot(tl.trans(ds).to(q.dtype), q, acc)
        # the rope tail has no p^T dO term
        if not ROPE:
            acc = tl.dot(tl.trans(p).to(do.dtype), do, acc)
    offs_c = tl.arange(0, BC)
    tl.atomic_add(dkv_ptr + rows[:, None] * K + col0 + offs_c[None, :], acc,
                  mask=valid[:, None] & (offs_c[None, :] < width), sem="relaxed")


def _tiles(H, V, R, max_heads, keys):
    return dict(BH=min(max_heads, max(16, triton.next_power_of_2(H))), BS=keys,
                BV=max(16, triton.next_power_of_2(V)), BR=max(16, triton.next_power_of_2(R)))


def _column_tiles(H, S, R, max_heads, keys, columns):
    """Tiles of the passes over column blocks (dq, dkv): BH heads, BS index slots, BC value and BCR rope columns."""
    return dict(BH=min(max_heads, max(16, triton.next_power_of_2(H))),
                BS=min(keys, max(16, triton.next_power_of_2(S))), BC=columns,
                BCR=min(columns, max(16, triton.next_power_of_2(R))))


def _num_column_blocks(V, R, tiles):
    return triton.cdiv(V, tiles["BC"]) + triton.cdiv(R, tiles["BCR"])


def _launch(kernel, B, T, H, V, R, max_heads, keys, *args):
    """One program per token and BH heads (see _token_and_head0)."""
    tiles = _tiles(H, V, R, max_heads, keys)
    fast(kernel)[(B * T * triton.cdiv(H, tiles["BH"]),)](*args, **tiles, num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def sparse_attention_fwd(q_BTHK, kv_BTK, idx_BTS, scale, v_dim):
    """-> (o_BTHV in q's dtype, lse_BTH fp32 in base 2, +inf for heads without keys)."""
    B, T, H, K = q_BTHK.shape
    S, R = idx_BTS.shape[-1], K - v_dim
    o_BTHV = buffers.empty(B, T, H, v_dim, dtype=q_BTHK.dtype, device=q_BTHK.device)
    lse_BTH = buffers.empty(B, T, H, dtype=torch.float32, device=q_BTHK.device)
    if gluon_attention.use_forward(q_BTHK, kv_BTK, v_dim) and gluon_attention.sparse_attention_fwd(q_BTHK, kv_BTK, idx_BTS, o_BTHV,
                                                                                  lse_BTH, scale):
        return o_BTHV, lse_BTH
    _launch(_fwd_kernel, B, T, H, v_dim, R, FWD_HEADS, FWD_KEYS,
            q_BTHK, kv_BTK, idx_BTS, o_BTHV, lse_BTH, scale * LOG2E, T, H, S, v_dim, R)
    return o_BTHV, lse_BTH


def sparse_attention_bwd(q_BTHK, kv_BTK, idx_BTS, o_BTHV, lse_BTH, do_BTHV, scale):
    """-> (dq_BTHK in q's dtype, dkv_BTK in kv's dtype); dkv is accumulated in fp32.
    Per chunk of BWD_CHUNK_TOKENS tokens: _bwd_scores_kernel (the chunk's p and scale * ds in q's dtype), then
    _bwd_dq_kernel and _bwd_dkv_kernel reading them back: the buffers are [chunk, H, S] each."""
    B, T, H, K = q_BTHK.shape
    S, V = idx_BTS.shape[-1], o_BTHV.shape[-1]
    R = K - V
    dq_BTHK = buffers.empty(*q_BTHK.shape, dtype=q_BTHK.dtype, device=q_BTHK.device)
    # atomically accumulated: must start at zero
    dkv32_BTK = torch.zeros(kv_BTK.shape, dtype=torch.float32, device=kv_BTK.device)
    chunk = min(B * T, BWD_CHUNK_TOKENS)
    p_CHS = buffers.empty(chunk, H, S, dtype=q_BTHK.dtype, device=q_BTHK.device)
    ds_CHS = buffers.empty(chunk, H, S, dtype=q_BTHK.dtype, device=q_BTHK.device)
    score_tiles = _tiles(H, V, R, SCORE_HEADS, SCORE_KEYS)
    dq_tiles = _column_tiles(H, S, R, DQ_HEADS, DQ_KEYS, DQ_COLUMNS)
    dkv_tiles = _column_tiles(H, S, R, DKV_HEADS, DKV_KEYS, DKV_COLUMNS)
    dq_programs = triton.cdiv(H, dq_tiles["BH"]) * _num_column_blocks(V, R, dq_tiles)
    dkv_slot_blocks = triton.cdiv(S, dkv_tiles["BS"])
    dkv_in_gluon = gluon_attention.use_dkv(q_BTHK, do_BTHV, S)
    for tok0 in range(0, B * T, chunk):
        n = min(chunk, B * T - tok0)
        fast(_bwd_scores_kernel)[(n * triton.cdiv(H, score_tiles["BH"]),)](
            q_BTHK, kv_BTK, idx_BTS, o_BTHV, do_BTHV, lse_BTH, p_CHS, ds_CHS, scale, scale * LOG2E, tok0,
            T, H, S, V, R, **score_tiles, num_warps=SCORE_WARPS, num_stages=SCORE_STAGES)
        fast(_bwd_dq_kernel)[(n * dq_programs,)](
            kv_BTK, idx_BTS, ds_CHS, dq_BTHK, tok0, T, H, S, V, R, **dq_tiles,
            num_warps=DQ_WARPS, num_stages=DQ_STAGES)
        if dkv_in_gluon and gluon_attention.dkv_pass(q_BTHK, idx_BTS, do_BTHV, p_CHS, ds_CHS, dkv32_BTK, tok0, n):
            continue
        # the rope tail in its own launch of narrower blocks without the p^T dO product (a branch between the two
        # block shapes inside one kernel slowed the value blocks, more than full-width rope blocks cost)
        for rope, width, columns in ((False, V, dkv_tiles["BC"]), (True, R, dkv_tiles["BCR"])):
            fast(_bwd_dkv_kernel)[(n * dkv_slot_blocks * triton.cdiv(width, columns),)](
                q_BTHK, idx_BTS, do_BTHV, p_CHS, ds_CHS, dkv32_BTK, tok0, T, H, S, V, R, BH=dkv_tiles["BH"],
                BS=dkv_tiles["BS"], BC=columns, ROPE=rope, num_warps=DKV_WARPS, num_stages=DKV_STAGES)
    return dq_BTHK, dkv32_BTK.to(kv_BTK.dtype)


class SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BTHK, kv_BTK, idx_BTS, scale, v_dim):
        q_BTHK, kv_BTK, idx_BTS = q_BTHK.contiguous(), kv_BTK.contiguous(), idx_BTS.to(torch.int32).contiguous()
        o_BTHV, lse_BTH = sparse_attention_fwd(q_BTHK, kv_BTK, idx_BTS, scale, v_dim)
        ctx.save_for_backward(q_BTHK, kv_BTK, idx_BTS, o_BTHV, lse_BTH)
        ctx.scale = scale
        return o_BTHV

    @staticmethod
    def backward(ctx, do_BTHV):
        q_BTHK, kv_BTK, idx_BTS, o_BTHV, lse_BTH = ctx.saved_tensors
        dq_BTHK, dkv_BTK = sparse_attention_bwd(q_BTHK, kv_BTK, idx_BTS, o_BTHV, lse_BTH,
                                                do_BTHV.contiguous(), ctx.scale)
        return dq_BTHK, dkv_BTK, None, None, None


def sparse_attention(q_BTHK, kv_BTK, idx_BTS, scale, v_dim) -> torch.Tensor:
    """Every head of query t attends over kv rows idx[b, t, :] (-1 = none); shared latent kv.

    q_BTHK [B, T, H, K], kv_BTK [B, T, K] with K > v_dim (values kv[..., :v_dim], the rest is
    the rope tail), idx_BTS [B, T, S] int -> o_BTHV [B, T, H, v_dim]. bf16/fp32 in, fp32 math.
    """
    if not 0 < v_dim < q_BTHK.shape[-1]:
        raise ValueError(f"sparse_attention: v_dim must be in (0, K={q_BTHK.shape[-1]}), got {v_dim}")
    return SparseAttention.apply(q_BTHK, kv_BTK, idx_BTS, scale, v_dim)
