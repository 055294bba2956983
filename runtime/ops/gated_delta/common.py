"""Triton helpers shared by the GDN/KDA kernels: in-chunk decayed Gram matrices, the UT inverse, the l2norm.

Shape legend: C chunk size, S sub-chunk size (C = NS * S), K key dim, X 1 (GDN) or K (KDA).
gc_CX is the in-chunk cumulative log decay: non-increasing down the rows, so exp(gc_i - gc_j) <= 1
for i >= j. Per-channel decays never form exp(-gc) alone (it overflows for strong decays): products
across sub-chunks are split at the rows bounding the pair's sub-chunks (decayed_grams), and pairs inside one
sub-chunk are summed exactly, element by element (diagonal.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

# exp(x) = 2^(x LOG2E): the decays are summed in log2 units where exp2 takes them
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def row_of(x, r, C: tl.constexpr):
    """Row r of x_C* as a vector."""
    rows = tl.arange(0, C)
    return tl.sum(tl.where(rows[:, None] == r, x, 0.0), 0)


@triton.jit
def decayed_grams(k_CK, q_CK, gc_CK, C: tl.constexpr, S: tl.constexpr, PREC: tl.constexpr):
    """Per-channel decay over the columns of the tiles, gc_CK in log2 units: (k k^T, q k^T) as row blocks
    [C / S, S, C], M[i, j] = sum_d x_id k_jd 2^(gc_id - gc_jd) for j in an earlier sub-chunk than i, else 0 (the
    S x S diagonal blocks are diagonal.py's).
    The decay between sub-chunks s > t splits at the first row of s (f) and the last row of t (l):
    2^(gc_i - f_s) 2^(f_s - l_t) 2^(l_t - gc_j), every exponent <= 0 as gc does not increase down the rows; no
    factor overflows, and one that underflows bounds a product that does too. The row factors take one exp a tile
    element; the middle factor [NS, NS, K] weighs every earlier key once per target sub-chunk, and one batched
    product per target sub-chunk gives its rows against all keys."""
    NS: tl.constexpr = C // S
    K: tl.constexpr = k_CK.shape[1]
    gc3 = tl.reshape(gc_CK, [NS, S, K])
    row = tl.arange(0, S)[None, :, None]
    first = tl.sum(tl.where(row == 0, gc3, 0.0), 1)
    last = tl.sum(tl.where(row == S - 1, gc3, 0.0), 1)
    to_first = tl.exp2(gc3 - first[:, None, :])
    sub = tl.arange(0, NS)
    # [target sub-chunk, key sub-chunk, K]; later or same key sub-chunks are masked before the exp (positive there)
    middle = tl.exp2(tl.where(sub[None, :, None] < sub[:, None, None], first[:, None, :] - last[None, :, :],
                              float("-inf")))
    k_last = tl.reshape(k_CK, [NS, S, K]) * tl.exp2(last[:, None, :] - gc3)
    keys = tl.reshape(middle[:, :, None, :] * k_last[None, :, :, :], [NS, C, K])
    keys_t = tl.permute(keys, (0, 2, 1))
    kk = tl.dot(tl.reshape(k_CK, [NS, S, K]) * to_first, keys_t, input_precision=PREC)
    qk = tl.dot(tl.reshape(q_CK, [NS, S, K]) * to_first, keys_t, input_precision=PREC)
    return kk, qk


@triton.jit
def decay_weighted(dm_CC, g_C):
    """Scalar decay: dM_ij exp(g_i - g_j) for M_ij = (a_i . c_j) exp(g_i - g_j), dM already masked to M's pattern;
    then da = (that) c and dc = (that)^T a."""
    rows = tl.arange(0, dm_CC.shape[0])
    return dm_CC * tl.exp(tl.where(rows[:, None] >= rows[None, :], g_C[:, None] - g_C[None, :], float("-inf")))


@triton.jit
def row_scales(norms_ptr, slot: tl.constexpr, scale, rows_R, valid_R, L2NORM: tl.constexpr):
    """scale / sqrt(sum x^2 + eps) of rows rows_R (token * H + head): the inverse norms prep stored [T, H, 2]
    (slot 0 k's with scale 1, slot 1 q's, which hold the scale), or scale alone without the l2norm."""
    if L2NORM:
        f_R = tl.load(norms_ptr + rows_R.to(tl.int64) * 2 + slot, mask=valid_R, other=0.0)
    else:
        f_R = tl.full([rows_R.shape[0]], 1.0, tl.float32) * scale
    return f_R


@triton.jit
def l2norm_bwd(y, inv, dy, USE: tl.constexpr):
    """dx of y = x * inv with inv = (sum x^2 + eps)^-1/2: inv (dy - y (y . dy))."""
    return inv[:, None] * (dy - y * tl.sum(y * dy, 1)[:, None]) if USE else dy


@triton.jit
def load_diag(ptr, tok_C, valid_C, head, H: tl.constexpr, C: tl.constexpr, S: tl.constexpr):
    """[C, C] with the S x S diagonal blocks read from rows [T, H, S] (diagonal.py), 0 elsewhere."""
    rows = tl.arange(0, C)
    same = (rows[:, None] // S) == (rows[None, :] // S)
    offs = (tok_C.to(tl.int64) * H + head)[:, None] * S + (rows % S)[None, :]
    return tl.load(ptr + offs, mask=same & valid_C[:, None], other=0.0).to(tl.float32)


@triton.jit
def store_diag(ptr, x_CC, tok_C, valid_C, head, H: tl.constexpr, C: tl.constexpr, S: tl.constexpr):
    """The S x S diagonal blocks of x_CC into rows [T, H, S]: the inverse of load_diag."""
    rows = tl.arange(0, C)
    same = (rows[:, None] // S) == (rows[None, :] // S)
    offs = (tok_C.to(tl.int64) * H + head)[:, None] * S + (rows % S)[None, :]
    tl.store(ptr + offs, x_CC.to(ptr.dtype.element_ty), mask=same & valid_C[:, None])


@triton.jit
def mm(a, b, PREC: tl.constexpr):
    """a @ b accumulated in fp32. PREC "bf16": bf16 operands on the tensor cores; "bf16_rounded": the same
    rounding with an fp32 product (the interpreter's bf16 tl.dot is wrong); otherwise tl.dot's
    input_precision on fp32 operands ("tf32", "tf32x3", "ieee")."""
    if PREC == "bf16":
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16_rounded":
        out = tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    return out


@triton.jit
def diag_block_inverse(l_BSS, S: tl.constexpr, PREC: tl.constexpr):
    """(I + L)^-1 of each strictly lower S x S block of l_BSS [NB, S, S], by doubling: with L^S = 0,
    (I + L)^-1 = (I - L)(I + L^2)(I + L^4) ... (I + L^(S/2)). Batched tensor-core products instead of
    S - 1 dependent row steps; PREC should be "tf32x3" (the partial products cancel where keys repeat,
    so they want fp32 accuracy)."""
    ii = tl.arange(0, S)
    power = -tl.where((ii[:, None] > ii[None, :])[None, :, :], l_BSS, 0.0)
    t_BSS = (ii[:, None] == ii[None, :]).to(tl.float32)[None, :, :] + power
    for j in tl.static_range(1, 8):
        if (1 << j) < S:
            power = tl.dot(power, power, input_precision=PREC)
            t_BSS += tl.dot(t_BSS, power, input_precision=PREC)
    return t_BSS


@triton.jit
def block_diagonal(x_BSS, C: tl.constexpr, S: tl.constexpr):
    """[C, C] with the C / S blocks of x_BSS [C / S, S, S] on its diagonal, 0 elsewhere."""
    NS: tl.constexpr = C // S
    blk = tl.arange(0, NS)
    same = blk[:, None, None, None] == blk[None, None, :, None]
    return tl.reshape(tl.where(same, tl.reshape(x_BSS, [NS, S, 1, S]), 0.0), [C, C])


@triton.jit
def merge_block_inverse(l_CC, td_CC, C: tl.constexpr, S: tl.constexpr, PREC: tl.constexpr):
    """(I + L)^-1 from td_CC, the inverses of the S x S diagonal blocks of I + L, merging neighbouring
    blocks level by level (S -> 2S -> ... -> C): for M = [[A, 0], [N, B]], M^-1 = T - T N T with
    T = blockdiag(A^-1, B^-1). Two products per level, log2(C / S) levels, where substituting block row by
    block row would take C / S - 1 dependent rounds."""
    rows = tl.arange(0, C)
    t_CC = td_CC
    for level in tl.static_range(0, 7):
        if (S << level) < C:
            pair_r = rows[:, None] // (2 * (S << level))
            pair_c = rows[None, :] // (2 * (S << level))
            lower_r = (rows[:, None] // (S << level)) % 2 == 1
            upper_c = (rows[None, :] // (S << level)) % 2 == 0
            n_CC = tl.where((pair_r == pair_c) & lower_r & upper_c, l_CC, 0.0)
            t_CC = t_CC - tl.dot(t_CC, tl.dot(n_CC, t_CC, input_precision=PREC), input_precision=PREC)
    return t_CC
