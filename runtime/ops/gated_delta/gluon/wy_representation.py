"""forward.prep_blocked_kernel in Gluon for Hopper (sm_90), GDN's (scalar decay): the same inputs, the same outputs
into the same buffers (w, u, P, gc_last, the row scales, and for a backward Tinv and the inverse norms), run in its
place where `use_prep` says the shapes allow. wy_representation_grad.py's programs are the model for the stages and
their loads.

Why Gluon: the Triton kernel (a program per chunk and head) waits on each round of its loads in turn, above all on
the column phase's loads of k and v, issued only once the inverse is done, and runs out of registers at its cap.
Here persistent programs of one warpgroup, two an SM, walk the work items (chunk, head) and
TMA-load the next item's tiles under this one's work: k and v into the second of two stages at the item's top, q into
its one stage once the Gram products, its last readers, are done.

Work item (chunk, head): q, k, v bf16 [C, 128] (rows of the chunk; all heads' columns of one row side by side in
HBM, so neighbouring programs take neighbouring heads of one chunk). Products (warpgroup MMAs, fp32 accumulators):
  k k^T and q k^T on the raw rows (bf16 operands: exact products, as the Triton kernel's), the rows' squared norms
  summed from shared memory while they run; L = (beta k_inv)_i (k k^T)_ij k_inv_j e^(gc_i - gc_j) below the
  diagonal, P = q_inv_i (q k^T)_ij k_inv_j e^(gc_i - gc_j) on and below it;
  Tinv = (I + L)^-1: the 16 x 16 diagonal blocks by forward substitution in fp32 (each block's rows are one warp's
  rows of the MMA layout, so the substitution's row and column broadcasts stay inside a warp), then the blocks merged
  level by level (16 -> 32 -> 64, forward.merge_block_inverse's T - T (N T)) on the tensor cores with each operand
  as two bf16 parts (hi + lo, state_grad._split_bf16), three products each;
  w = (Tinv diag(beta k_inv e^gc)) k and u = (Tinv diag(beta)) v by 64-column halves, the row factors folded into
  Tinv's columns so that k and v enter as stored.
Precision: the Triton kernel doubles the diagonal blocks at tf32x3 and merges at tf32; here the substitution is fp32
and the merges ~16 bits a part. A CPU model of both against fp64 inverses (identical keys, beta 1, slow decay: the
cancelling case) gives 1.7e-5 relative error here, 1.3e-3 for the Triton kernel's. For w and u the
Triton kernel rounds Tinv and the scaled key or value block to bf16 as operands; here the scaled Tinv once.

Rows past a chunk's end: TMA reads them (the next chunk's tokens, or zeros past T). Their beta and g load as 0, which
zeroes their rows of L and, through Tinv's columns, their share in w and u; the stores skip them.

Shape legend: T tokens, H heads, K key dim, V value dim, C chunk size, NC chunks, S the diagonal blocks' size,
NB = C / S blocks.
"""
from __future__ import annotations

import torch

from runtime.ops.gated_delta.gluon import state_grad
from runtime.ops.gated_delta.gluon.state_grad import CHUNK, KEY_DIM, VALUE_DIM, gluon
from runtime.ops.common.gluon_fallback import compiles, num_sms
from runtime.ops.gated_delta.backend import SELECTOR

# programs an SM: each of one warpgroup, its stages its own
PROGRAMS_PER_SM = 2
# the shared memory a program may take for PROGRAMS_PER_SM of them on an SM: 228 KB an SM, 1 KB the driver's a program
SHARED_BYTES_PER_PROGRAM = 228 * 1024 // PROGRAMS_PER_SM - 1024
# the diagonal blocks forward substitution inverts: the rows of one warp of the MMA layout (16 of them)
SUB_BLOCK = 16


def prep_fits(K: int, V: int, C: int, dtype: torch.dtype, per_channel: bool) -> bool:
    """Whether the kernel's tiles take these shapes: the scalar decay, bf16 inputs, K = V = 128, C = 64."""
    return not per_channel and dtype == torch.bfloat16 and K == KEY_DIM and V == VALUE_DIM and C == CHUNK


def use_prep(q_THK: torch.Tensor, v_THV: torch.Tensor, C: int, per_channel: bool) -> bool:
    """A Hopper GPU runs the tensors, this triton has Gluon, and prep_fits (q and v in one dtype)."""
    return (gluon is not None and q_THK.is_cuda and SELECTOR.choose(q_THK.device) == "hopper"
            and q_THK.dtype == v_THV.dtype
            and prep_fits(q_THK.shape[-1], v_THV.shape[-1], C, q_THK.dtype, per_channel))


if gluon is not None:
    from runtime.ops.gated_delta.gluon.state_grad import (
        _add, _barrier, _full_barriers, _released, _row_dot_vector, _split_bf16, _store_rows, _store_rows_through,
        _tma_load, fence_async_shared, gl, mbarrier, warpgroup_mma, warpgroup_mma_wait,
    )
    from runtime.ops.gated_delta.gluon.wy_representation_grad import HALF, _columns

    # [C, 64] accumulators: the Gram products, the merges' [C, C] and w's and u's column halves
    MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))

    @gluon.jit
    def _load_q(q_desc, q_s, bar, start, head):
        C: gl.constexpr = q_s.shape[0]
        K: gl.constexpr = q_s.shape[1]
        mbarrier.expect(bar, 2 * C * K)
        _tma_load(q_desc, [start, head * K], bar, q_s)

    @gluon.jit
    def _load_kv(k_desc, v_desc, k_s, v_s, bar, start, head):
        C: gl.constexpr = k_s.shape[0]
        K: gl.constexpr = k_s.shape[1]
        V: gl.constexpr = v_s.shape[1]
        mbarrier.expect(bar, 2 * C * (K + V))
        _tma_load(k_desc, [start, head * K], bar, k_s)
        _tma_load(v_desc, [start, head * V], bar, v_s)

    @gluon.jit
    def _row_loads(g_ptr, beta_ptr, start, count, head, H, C: gl.constexpr):
        """(g, beta) of a chunk's rows as loaded, [C] in a blocked layout, 0 past its end: issued for the next item
        under this one's work, finished (_row_inputs) at its top."""
        SCAN: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        rows = gl.arange(0, C, layout=SCAN)
        tok = (start + rows).to(gl.int64) * H + head
        return gl.load(g_ptr + tok, mask=rows < count, other=0.0), gl.load(beta_ptr + tok, mask=rows < count, other=0.0)

    @gluon.jit
    def _row_inputs(g, beta):
        """(gc the in-chunk cumulative log decay, beta) fp32 [C] in MMA's row slice. The scan runs in the loads'
        blocked layout (triton's scan does not take an MMA's slices)."""
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        gc = gl.convert_layout(gl.associative_scan(g.to(gl.float32), 0, _add), ROW)
        return gc, gl.convert_layout(beta.to(gl.float32), ROW)

    @gluon.jit
    def _grams(q_s, k_s, scale, L2NORM: gl.constexpr):
        """(k k^T, q k^T [C, C] fp32 in MMA, k's and q's row factors [C] in MMA's row slice: 1 / |row| (q's times
        `scale`), or 1 and `scale` without the l2norm). The norms are summed from shared memory while the products
        run."""
        C: gl.constexpr = q_s.shape[0]
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        square = gl.zeros([C, C], gl.float32, layout=MMA)
        kk = warpgroup_mma(k_s, k_s.permute((1, 0)), square, use_acc=False, is_async=True)
        qk = warpgroup_mma(q_s, k_s.permute((1, 0)), square, use_acc=False, is_async=True)
        if L2NORM:
            LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [gl.num_warps(), 1], [1, 0])
            k_inv = gl.convert_layout(1.0 / gl.sqrt(_row_dot_vector(k_s, k_s, LOAD) + 1e-6), ROW)
            q_inv = gl.convert_layout(1.0 / gl.sqrt(_row_dot_vector(q_s, q_s, LOAD) + 1e-6), ROW) * scale
        else:
            k_inv = gl.full([C], 1.0, gl.float32, layout=ROW)
            q_inv = k_inv * scale
        kk, qk = warpgroup_mma_wait(num_outstanding=0, deps=(kk, qk))
        return kk, qk, k_inv, q_inv

    @gluon.jit
    def _decayed(kk, qk, gc, beta, k_inv, q_inv):
        """(L strictly lower, P on and below the diagonal) [C, C] fp32, as forward.prep_blocked_kernel's."""
        C: gl.constexpr = kk.shape[0]
        rows = gl.arange(0, C, layout=gl.SliceLayout(1, MMA))[:, None]
        cols = gl.arange(0, C, layout=gl.SliceLayout(0, MMA))[None, :]
        decay = gl.exp(gl.where(rows >= cols, gc[:, None] - _columns(gc, MMA), float("-inf")))
        k_cols = _columns(k_inv, MMA)
        l_mat = gl.where(rows > cols, (beta * k_inv)[:, None] * kk * k_cols * decay, 0.0)
        return l_mat, q_inv[:, None] * qk * k_cols * decay

    @gluon.jit
    def _diagonal_inverse(l_mat, S: gl.constexpr):
        """The inverses of the S x S diagonal blocks of I + L, as a block-diagonal [C, C] fp32 in MMA, by forward
        substitution in fp32: for j < S, T[i, :] -= L[i, j] T[j, :] (row j is final once the columns before it are
        done). In [NB, S, S] (block, row, column) the blocks' rows are one warp's each in the MMA layout: the
        broadcasts of T's row j and L's column j are shuffles inside a warp, and the reshapes move no data."""
        C: gl.constexpr = l_mat.shape[0]
        NB: gl.constexpr = C // S
        l4 = gl.reshape(l_mat, [NB, S, NB, S])
        L4: gl.constexpr = l4.type.layout
        B3: gl.constexpr = gl.SliceLayout(2, L4)
        blk_r = gl.arange(0, NB, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
        blk_c = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
        same = blk_r[:, None, None, None] == blk_c[None, None, :, None]
        # the column block is a register index of MMA's layout: the sum stays in each thread
        diag = gl.sum(gl.where(same, l4, 0.0), 2)
        row = gl.arange(0, S, layout=gl.SliceLayout(0, gl.SliceLayout(2, B3)))[None, :, None]
        col = gl.arange(0, S, layout=gl.SliceLayout(0, gl.SliceLayout(1, B3)))[None, None, :]
        t = gl.where(row == col, 1.0, 0.0) + gl.zeros([NB, S, S], gl.float32, layout=B3)
        for j in gl.static_range(S):
            t_row = gl.sum(gl.where(row == j, t, 0.0), 1)
            l_col = gl.sum(gl.where(col == j, diag, 0.0), 2)
            t = t - l_col[:, :, None] * t_row[:, None, :]
        blocks = gl.where(same, t[:, :, None, :], 0.0)
        return gl.convert_layout(gl.reshape(blocks, [C, C]), MMA)

    @gluon.jit
    def _product(a, b, b_s):
        """a @ b [C, C] fp32 in MMA for fp32 a, b in MMA, each operand as bf16 hi + lo (~16 bits): hi hi + hi lo +
        lo hi, three MMAs; b through the two tiles of b_s [2, C, C] bf16."""
        C: gl.constexpr = a.shape[0]
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        b_hi, b_lo = _split_bf16(b)
        # every warp's reads of the tiles (the products before, the stores through them) are done
        _barrier()
        b_s.index(0).store(b_hi)
        b_s.index(1).store(b_lo)
        fence_async_shared()
        _barrier()
        a_hi, a_lo = _split_bf16(a)
        a_hi = gl.convert_layout(a_hi, DOT)
        a_lo = gl.convert_layout(a_lo, DOT)
        acc = gl.zeros([C, C], gl.float32, layout=MMA)
        acc = warpgroup_mma(a_hi, b_s.index(0), acc, use_acc=False, is_async=True)
        acc = warpgroup_mma(a_hi, b_s.index(1), acc, is_async=True)
        acc = warpgroup_mma(a_lo, b_s.index(0), acc, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    @gluon.jit
    def _inverse(l_mat, b_s, S: gl.constexpr):
        """Tinv = (I + L)^-1 [C, C] fp32 in MMA: the diagonal blocks' inverses, then forward.merge_block_inverse's
        levels, M^-1 = T - T N T for M = [[A, 0], [N, B]] and T = blockdiag(A^-1, B^-1)."""
        C: gl.constexpr = l_mat.shape[0]
        t = _diagonal_inverse(l_mat, S)
        rows = gl.arange(0, C, layout=gl.SliceLayout(1, MMA))[:, None]
        cols = gl.arange(0, C, layout=gl.SliceLayout(0, MMA))[None, :]
        for level in gl.static_range(0, 7):
            if (S << level) < C:
                pair_r = rows // (2 * (S << level))
                pair_c = cols // (2 * (S << level))
                below = (pair_r == pair_c) & ((rows // (S << level)) % 2 == 1) & ((cols // (S << level)) % 2 == 0)
                t = t - _product(t, _product(gl.where(below, l_mat, 0.0), t, b_s), b_s)
        return t

    @gluon.jit
    def _column_outputs(tinv, factors, x_s, out_ptr, tile, start, count, head, H):
        """(Tinv diag(factors)) x by 64-column halves into out_ptr's rows: bf16 outputs through `tile` (a [C, 64]
        bf16 tile of shared memory: whole rows a warp's store), fp32 ones from the accumulators."""
        C: gl.constexpr = x_s.shape[0]
        D: gl.constexpr = x_s.shape[1]
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        a = gl.convert_layout((tinv * _columns(factors, MMA)).to(gl.bfloat16), DOT)
        half = gl.zeros([C, HALF], gl.float32, layout=MMA)
        for h in gl.static_range(D // HALF):
            acc = warpgroup_mma(a, x_s.slice(h * HALF, HALF, dim=1), half, use_acc=False)
            if out_ptr.dtype.element_ty == gl.float32:
                _store_rows(out_ptr, acc, start, count, head, h * HALF, H, D, MMA)
            else:
                # the tile's readers before (a store through it, the products) are done
                _barrier()
                _store_rows_through(out_ptr, acc, tile, start, count, head, h * HALF, H, D)

    @gluon.jit
    def _store_row_values(glast_ptr, row_scales_ptr, norms_ptr, gc, k_inv, q_inv, chunk, start, count, head, H):
        """gc_last [NC, H], the scans' row factors [T, H, 2] (kbar's k_inv e^(gc_last - gc), qg's q_inv e^gc) and for
        a backward with the l2norm the inverse norms [T, H, 2] (k's, q's times the scale)."""
        C: gl.constexpr = gc.shape[0]
        rows = gl.arange(0, C, layout=gl.SliceLayout(1, MMA))
        last = gl.sum(gl.where(rows == C - 1, gc, 0.0), 0)
        gl.store(glast_ptr + chunk.to(gl.int64) * H + head, last)
        offs = ((start + rows).to(gl.int64) * H + head) * 2
        valid = rows < count
        gl.store(row_scales_ptr + offs, k_inv * gl.exp(last - gc), mask=valid)
        gl.store(row_scales_ptr + offs + 1, q_inv * gl.exp(gc), mask=valid)
        if norms_ptr is not None:
            gl.store(norms_ptr + offs, k_inv, mask=valid)
            gl.store(norms_ptr + offs + 1, q_inv, mask=valid)

    @gluon.jit
    def prep_kernel(q_desc, k_desc, v_desc, g_ptr, beta_ptr, chunk_start_ptr, chunk_end_ptr, w_ptr, u_ptr, p_ptr,
                    glast_ptr, row_scales_ptr, tinv_ptr, norms_ptr, scale, num_items, H, zero, L2NORM: gl.constexpr,
                    S: gl.constexpr, num_warps: gl.constexpr):
        """forward.prep_blocked_kernel's outputs (scalar decay) for num_items = NC * H items (chunk, head),
        persistent programs of one warpgroup (num_warps 4), two an SM, each walking every P-th item: w [T, H, K]
        and P [T, H, C] bf16, u [T, H, V] fp32, gc_last [NC, H] and the row factors [T, H, 2] fp32, and, unless
        their pointers are None, Tinv [T, H, C] bf16 and the inverse norms [T, H, 2] fp32. The descriptors view q, k
        as [T, H K] and v as [T, H V] ([C, 128] blocks, bf16); g and beta [T, H]; `zero` is 0."""
        C: gl.constexpr = q_desc.block_type.shape[0]
        K: gl.constexpr = q_desc.block_type.shape[1]
        V: gl.constexpr = v_desc.block_type.shape[1]
        q_s = gl.allocate_shared_memory(gl.bfloat16, [1, C, K], q_desc.layout)
        k_s = gl.allocate_shared_memory(gl.bfloat16, [2, C, K], k_desc.layout)
        v_s = gl.allocate_shared_memory(gl.bfloat16, [2, C, V], v_desc.layout)
        b_s = gl.allocate_shared_memory(gl.bfloat16, [2, C, C], gl.NVMMASharedLayout.get_default_for([C, C],
                                                                                                     gl.bfloat16))
        q_ready = _full_barriers(1)
        kv_ready = _full_barriers(2)
        stride = gl.num_programs(0)
        first = gl.program_id(0)
        start = gl.load(chunk_start_ptr + first // H)
        count = gl.load(chunk_end_ptr + first // H) - start
        _load_q(q_desc, q_s.index(0), q_ready.index(0), start, first % H)
        _load_kv(k_desc, v_desc, k_s.index(0), v_s.index(0), kv_ready.index(0), start, first % H)
        g, beta = _row_loads(g_ptr, beta_ptr, start, count, first % H, H, C)
        n = 0
        for item in range(first, num_items, stride):
            chunk, head = item // H, item % H
            # the stages' indices change with the item as far as the compiler knows (`zero` is 0): with constant ones
            # it hoists every MMA descriptor out of the loop, where they do not fit in registers (state_grad.py's
            # _consumer)
            qs = item * zero
            s = n % 2
            more = item + stride < num_items
            next_item = item + stride
            next_start = gl.load(chunk_start_ptr + next_item // H, mask=more, other=0)
            next_count = gl.load(chunk_end_ptr + next_item // H, mask=more, other=0) - next_start
            # the other stage's readers (the item before) are past _released
            if more:
                _load_kv(k_desc, v_desc, k_s.index(1 - s), v_s.index(1 - s), kv_ready.index(1 - s), next_start,
                         next_item % H)
            gc, beta_r = _row_inputs(g, beta)
            g, beta = _row_loads(g_ptr, beta_ptr, next_start, next_count, next_item % H, H, C)
            mbarrier.wait(q_ready.index(qs), n % 2)
            mbarrier.wait(kv_ready.index(s), (n // 2) % 2)
            kk, qk, k_inv, q_inv = _grams(q_s.index(qs), k_s.index(s), scale, L2NORM)
            _released()
            if more:
                _load_q(q_desc, q_s.index(qs), q_ready.index(qs), next_start, next_item % H)
            l_mat, p_mat = _decayed(kk, qk, gc, beta_r, k_inv, q_inv)
            _barrier()
            _store_rows_through(p_ptr, p_mat, b_s.index(0), start, count, head, 0, H, C)
            tinv = _inverse(l_mat, b_s, S)
            if tinv_ptr is not None:
                _barrier()
                _store_rows_through(tinv_ptr, tinv, b_s.index(0), start, count, head, 0, H, C)
            _column_outputs(tinv, beta_r * k_inv * gl.exp(gc), k_s.index(s), w_ptr, b_s.index(1), start, count,
                            head, H)
            _column_outputs(tinv, beta_r, v_s.index(s), u_ptr, b_s.index(1), start, count, head, H)
            _store_row_values(glast_ptr, row_scales_ptr, norms_ptr, gc, k_inv, q_inv, chunk, start, count, head, H)
            # this stage's readers are done before the next item loads the item after it into the stage
            _released()
            start, count = next_start, next_count
            n += 1


def prep(q, k, v, g, beta, chunk_start, chunk_end, w, u, p, glast, row_scales, tinv, norms, scale,
         l2norm: bool) -> bool:
    """forward.prep_blocked_kernel's outputs for the scalar decay (use_prep must hold): q, k [T, H, K], v [T, H, V]
    bf16, g, beta [T, H]; writes w, P bf16, u fp32, gc_last [NC, H, 1] and the row factors [T, H, 2] fp32, Tinv
    [T, H, C] bf16 and the norms [T, H, 2] fp32 unless None. Returns False where the kernel does not compile here
    (nothing written)."""
    H = q.shape[1]
    num_items = glast.shape[0] * H
    grid = (min(num_items, PROGRAMS_PER_SM * num_sms(q.device.index or 0)),)
    descs = [state_grad._rows_desc(t, t.shape[-1]) for t in (q, k, v)]
    return compiles("GDN prep", lambda: prep_kernel[grid](
        *descs, g, beta, chunk_start, chunk_end, w, u, p, glast, row_scales, tinv, norms, scale, num_items, H, 0,
        L2NORM=l2norm, S=SUB_BLOCK, num_warps=4))
