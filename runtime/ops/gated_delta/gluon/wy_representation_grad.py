"""backward.wy_grad_kernel in Gluon for Hopper (sm_90), GDN's (scalar decay): the same inputs, the same outputs into
the same buffers (dv, the final dq and dk through the l2norm, dbeta, dg), run in its place where `use_wy_grad` says
the shapes allow. state_grad.py's kernels are the model for the stages and their loads; the programs differ.

Why Gluon: the Triton kernel (a program per chunk and head, two 4-warp programs an SM) waits on each round of its
loads in turn. Here persistent programs of one warpgroup, two an SM, walk the work items
(chunk, head), each in a stage of shared memory of its own (112 KB: six row tiles, Tinv's and dTinv's), and TMA-load
the next item's tiles into it in two parts, each as soon as this item's last reader of it is done. Two programs, not
one of two warpgroups (warp_specialize, state_grad.py's KDA scheme): the two warpgroups there run two copies of a
long loop, and their warps wait on fetching instructions; the two programs of an SM run one copy.

Work item (chunk, head), its tiles in one stage, bf16 [C, 128] (rows of the chunk, all heads' columns of one row
side by side in HBM, so neighbouring programs take neighbouring heads of one chunk), in three parts on a barrier
each:
  q, dv_new, v (ready): the value products first, while the second part may still be in flight;
  k, dw, pdq (the partial dq; keys_ready): dq's finish, then the key products; then pdq's slot takes this item's
  partial dk (pdk_ready), which the decayed Gram backward adds its share to in place (rounded to bf16 as the Triton
  kernel's stored partial is) and dk's finish reads.
The next item's q, dv_new and v load after the key products (their last readers), its k, dw and partial dq after
dk's finish.
Tinv (bf16 [C, C] rows in HBM: prep stores it in the storage dtype) is TMA-loaded into a tile of the program (tinv_s)
on the first part's barrier, issued once the decayed Gram backward, its last reader, is done; a short chunk's rows past
its end are zeroed there after the wait (the Triton kernel's masked loads give 0): every product takes it as a bf16
operand, as the Triton kernel's GRAD_DOTS "bf16" does. An item's first token and count come from the item before, its
g is loaded under the item before, and dg's slots of state_grad's dgc at the item's top (the adds at its end): each was
a load a warp waited on right away.

Products (warpgroup MMAs, fp32 accumulators), as the Triton kernel's, in its order of rounding:
  dbv = Tinv^T du (du = dv_new) by value half, dv = beta dbv;  tdw = Tinv^T dw by key half;
  dTinv = du (beta v)^T + dw (beta k e^gc)^T;  dL = -(Tinv^T dTinv) Tinv^T on the strictly lower pattern
  (dTinv and the inner product rounded to bf16); dme = dL e^(gc_i - gc_j);
  da = (dme k_inv) k_raw, dc = (dme beta k_inv)^T k_raw by key half, tdw recomputed there as the Triton kernel does.
One difference: the Triton kernel rounds beta v and beta k_inv k e^gc to bf16 as dTinv's operands; here v and the
raw k enter as stored (exact) and the row factors scale dTinv's columns in fp32 after the products (no tile of
scaled operands in shared memory): dTinv differs from the Triton kernel's by 1.7e-3 relative RMS (a CPU model, odd
lengths, with and without the l2norm), below its own bf16 rounding as the next product's operand; the CPU model of
this kernel's outputs against the Triton kernel's differs by 4e-3 to 7e-3, their bf16 rounding
(tests/ops/gated_delta/test_kernel_gated_delta_wy_representation_grad_gluon.py).
dTinv goes through shared memory as the inner product's B operand (dtinv_s), dme's scaled transpose after it in
the same tile as dc's A operand.

Rows past a chunk's end: TMA reads them (the next chunk's tokens, or zeros past T). Tinv's rows there are 0, which
zeroes their share in every Tinv^T product; beta's 0 zeroes dTinv's columns and dc's rows; dTinv's rows and the dgc
sums are masked; the stores skip them.

Registers and shared memory (sm_90a): two programs an SM take the whole register file (2 x 128 threads x 256) and
114,984 bytes of shared memory each (228 KB an SM, 1 KB of it the driver's a program). To keep
the item loop's live values within them: a barrier between the passes
of dq's l2norm backward (the compiler kept the first pass's loads of both tiles live for the second), dk's row dots
summed where the finished partial dk is in registers, and the decayed Gram backward's products folded one at a time
into dk's running sum.

Shape legend: T tokens, H heads, K key dim, V value dim, C chunk size, NC chunks, NK state_grad's key blocks (the
slots of dgc and dgl), KH = VH = 64 (a key or value half of a tile).
"""
from __future__ import annotations

import torch

from runtime.ops.gated_delta.gluon import state_grad
from runtime.ops.gated_delta.gluon.state_grad import CHUNK, KEY_DIM, VALUE_DIM, gluon
from runtime.ops.common.gluon_fallback import compiles, num_sms
from runtime.ops.gated_delta.backend import SELECTOR

# programs an SM: each of one warpgroup, its own stage and half the register file
PROGRAMS_PER_SM = 2
# the shared memory a program may take for PROGRAMS_PER_SM of them on an SM: 228 KB an SM, 1 KB the driver's a program
SHARED_BYTES_PER_PROGRAM = 228 * 1024 // PROGRAMS_PER_SM - 1024

def wy_grad_fits(K: int, V: int, C: int, dtype: torch.dtype, per_channel: bool) -> bool:
    """Whether the kernel's tiles take these shapes: the scalar decay, bf16 storage, K = V = 128, C = 64."""
    return not per_channel and dtype == torch.bfloat16 and K == KEY_DIM and V == VALUE_DIM and C == CHUNK


def use_wy_grad(q_THK: torch.Tensor, v_THV: torch.Tensor, dv_new: torch.Tensor, C: int, per_channel: bool) -> bool:
    """A Hopper GPU runs the tensors, this triton has Gluon, and wy_grad_fits (q, v and dv_new in one dtype)."""
    return (gluon is not None and q_THK.is_cuda and SELECTOR.choose(q_THK.device) == "hopper"
            and q_THK.dtype == v_THV.dtype == dv_new.dtype
            and wy_grad_fits(q_THK.shape[-1], v_THV.shape[-1], C, dv_new.dtype, per_channel))


if gluon is not None:
    from runtime.ops.gated_delta.gluon.state_grad import (
        _barrier, _released, _row_inputs, _row_loads, _store_rows, _tma_load, fence_async_shared, gl, mbarrier,
        warpgroup_mma, warpgroup_mma_wait,
    )

    # the columns of a key or value half: dbv's, tdw's, da's and dc's accumulators by half hold 32 registers a thread
    HALF = gl.constexpr(64)
    # the finishes' [C, 32] column blocks: 16 bytes a thread a row
    FINISH = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0]))

    @gluon.jit
    def _load_values(tiles, s, start, head):
        """TMA of an item's q, dv_new and v into stage s, on its ready barrier."""
        (dvn_desc, v_desc, k_desc, w_desc, q_desc, pdq_desc, pdk_desc, dvn_s, v_s, k_s, w_s, q_s, pq_s, ready,
         keys_ready, pdk_ready) = tiles
        C: gl.constexpr = v_s.shape[1]
        V: gl.constexpr = v_s.shape[2]
        K: gl.constexpr = q_s.shape[2]
        bar = ready.index(s)
        # and the item's Tinv [C, C], loaded later (_load_tinv)
        mbarrier.expect(bar, 2 * C * (K + 2 * V + C))
        _tma_load(q_desc, [start, head * K], bar, q_s.index(s))
        _tma_load(dvn_desc, [start, head * V], bar, dvn_s.index(s))
        _tma_load(v_desc, [start, head * V], bar, v_s.index(s))

    @gluon.jit
    def _load_keys(tiles, s, start, head):
        """TMA of an item's k, dw and partial dq into stage s, on its keys_ready barrier."""
        (dvn_desc, v_desc, k_desc, w_desc, q_desc, pdq_desc, pdk_desc, dvn_s, v_s, k_s, w_s, q_s, pq_s, ready,
         keys_ready, pdk_ready) = tiles
        C: gl.constexpr = k_s.shape[1]
        K: gl.constexpr = k_s.shape[2]
        bar = keys_ready.index(s)
        mbarrier.expect(bar, 3 * C * K * 2)
        _tma_load(k_desc, [start, head * K], bar, k_s.index(s))
        _tma_load(w_desc, [start, head * K], bar, w_s.index(s))
        _tma_load(pdq_desc, [start, head * K], bar, pq_s.index(s))

    @gluon.jit
    def _load_pdk(tiles, s, start, head):
        """TMA of an item's partial dk into stage s's pdq slot (dq's finish is done with it), on its own barrier."""
        (dvn_desc, v_desc, k_desc, w_desc, q_desc, pdq_desc, pdk_desc, dvn_s, v_s, k_s, w_s, q_s, pq_s, ready,
         keys_ready, pdk_ready) = tiles
        C: gl.constexpr = pq_s.shape[1]
        K: gl.constexpr = pq_s.shape[2]
        bar = pdk_ready.index(s)
        mbarrier.expect(bar, C * K * 2)
        _tma_load(pdk_desc, [start, head * K], bar, pq_s.index(s))

    @gluon.jit
    def _load_tinv(tinv_desc, tinv_s, bar, start, head):
        """TMA of an item's Tinv [C, C] (bf16 rows [T, H C] in HBM) into tinv_s, on the stage's ready barrier, whose
        expect (_load_values') counts its bytes."""
        C: gl.constexpr = tinv_s.shape[0]
        _tma_load(tinv_desc, [start, head * C], bar, tinv_s)

    @gluon.jit
    def _mask_tinv(tinv_s, count):
        """Zero Tinv's rows past a short chunk's end, where the TMA read the next chunk's (the Triton kernel's masked
        loads give 0 there), before any product reads it."""
        C: gl.constexpr = tinv_s.shape[0]
        if count < C:
            LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [gl.num_warps(), 1], [1, 0])
            rows = gl.arange(0, C, layout=gl.SliceLayout(1, LOAD))
            # each thread writes back what it read: no other thread's reads to wait for
            tinv_s.store(gl.where((rows < count)[:, None], tinv_s.load(LOAD), 0.0))
            fence_async_shared()
            _barrier()

    @gluon.jit
    def _row_dots(x_s, part_s, inv, dy_scale):
        """sum over K of y dx by row, y = x inv and dx = part dy_scale (the l2norm backward's), fp32 [C] in
        FINISH's row slice, from [C, K] bf16 tiles in shared memory; inv [C] fp32 in any layout. 32 columns at a
        time."""
        C: gl.constexpr = x_s.shape[0]
        inv = gl.convert_layout(inv, gl.SliceLayout(1, FINISH))
        dot = gl.zeros([C], gl.float32, layout=gl.SliceLayout(1, FINISH))
        for c in gl.static_range(x_s.shape[1] // 32):
            y = x_s.slice(c * 32, 32, dim=1).load(FINISH).to(gl.float32) * inv[:, None]
            dot += gl.sum(y * (part_s.slice(c * 32, 32, dim=1).load(FINISH).to(gl.float32) * dy_scale), 1)
        return dot

    @gluon.jit
    def _finish_rows(x_s, part_s, inv, dy_scale, dot, out_ptr, start, count, head, H, L2NORM: gl.constexpr):
        """backward.finish_rows from shared memory: dx = part dy_scale of the chunk's whole rows through the l2norm
        (y = x inv, dx <- inv (dx - y dot), dot = _row_dots'), stored in out_ptr's dtype; x and part [C, K] bf16
        tiles, inv and dot [C] fp32 in any layout. 32 columns at a time."""
        K: gl.constexpr = x_s.shape[1]
        inv = gl.convert_layout(inv, gl.SliceLayout(1, FINISH))
        dot = gl.convert_layout(dot, gl.SliceLayout(1, FINISH))
        for c in gl.static_range(K // 32):
            dx = part_s.slice(c * 32, 32, dim=1).load(FINISH).to(gl.float32) * dy_scale
            if L2NORM:
                y = x_s.slice(c * 32, 32, dim=1).load(FINISH).to(gl.float32) * inv[:, None]
                dx = inv[:, None] * (dx - y * dot[:, None])
            _store_rows(out_ptr, dx, start, count, head, c * 32, H, K, FINISH)

    @gluon.jit
    def _columns(x, MMA: gl.constexpr):
        """A row vector [C] (MMA's row slice) as a column vector of MMA."""
        return gl.convert_layout(x, gl.SliceLayout(0, MMA))[None, :]

    @gluon.jit
    def _value_products(tinv_s, dvn_s, v_s, beta, dv_ptr, start, count, head, H, MMA: gl.constexpr):
        """db's share from u (sum over V of dbv v) [C] of stage tiles, storing dv = beta dbv, dbv = Tinv^T du by
        value half."""
        C: gl.constexpr = dvn_s.shape[0]
        V: gl.constexpr = dvn_s.shape[1]
        tinv_t = tinv_s.permute((1, 0))
        half = gl.zeros([C, HALF], gl.float32, layout=MMA)
        dbv0 = warpgroup_mma(tinv_t, dvn_s.slice(0, HALF, dim=1), half, use_acc=False, is_async=True)
        dbv1 = warpgroup_mma(tinv_t, dvn_s.slice(HALF, HALF, dim=1), half, use_acc=False, is_async=True)
        dbv0, dbv1 = warpgroup_mma_wait(num_outstanding=0, deps=(dbv0, dbv1))
        _store_rows(dv_ptr, beta[:, None] * dbv0, start, count, head, 0, H, V, MMA)
        _store_rows(dv_ptr, beta[:, None] * dbv1, start, count, head, HALF, H, V, MMA)
        db = gl.sum(dbv0 * v_s.slice(0, HALF, dim=1).load(MMA).to(gl.float32), 1)
        return db + gl.sum(dbv1 * v_s.slice(HALF, HALF, dim=1).load(MMA).to(gl.float32), 1)

    @gluon.jit
    def _key_products(tinv_s, dvn_s, v_s, k_s, w_s, beta, k_inv, eg, count, MMA: gl.constexpr):
        """(db's share from w (sum over K of tdw k e^gc, tdw = Tinv^T dw) [C], dTinv [C, C] fp32 with its rows past
        the chunk's end 0) of stage tiles: dTinv = (du v^T) beta_j + (dw k_raw^T) (beta k_inv e^gc)_j, its two
        products in flight together, then tdw's two key halves together."""
        C: gl.constexpr = dvn_s.shape[0]
        tinv_t = tinv_s.permute((1, 0))
        square = gl.zeros([C, C], gl.float32, layout=MMA)
        half = gl.zeros([C, HALF], gl.float32, layout=MMA)
        acc_v = warpgroup_mma(dvn_s, v_s.permute((1, 0)), square, use_acc=False, is_async=True)
        acc_k = warpgroup_mma(w_s, k_s.permute((1, 0)), square, use_acc=False, is_async=True)
        acc_v, acc_k = warpgroup_mma_wait(num_outstanding=0, deps=(acc_v, acc_k))
        rows = gl.arange(0, C, layout=gl.SliceLayout(1, MMA))
        dtinv = acc_v * _columns(beta, MMA) + acc_k * _columns(beta * k_inv * eg, MMA)
        dtinv = gl.where((rows < count)[:, None], dtinv, 0.0)
        tdw0 = warpgroup_mma(tinv_t, w_s.slice(0, HALF, dim=1), half, use_acc=False, is_async=True)
        tdw1 = warpgroup_mma(tinv_t, w_s.slice(HALF, HALF, dim=1), half, use_acc=False, is_async=True)
        tdw0, tdw1 = warpgroup_mma_wait(num_outstanding=0, deps=(tdw0, tdw1))
        db = gl.sum(tdw0 * k_s.slice(0, HALF, dim=1).load(MMA).to(gl.float32), 1)
        db += gl.sum(tdw1 * k_s.slice(HALF, HALF, dim=1).load(MMA).to(gl.float32), 1)
        return db * k_inv * eg, dtinv

    @gluon.jit
    def _decayed_dl(dtinv, tinv_s, dtinv_s, gc, start, MMA: gl.constexpr):
        """dme = dL_ij e^(gc_i - gc_j) [C, C] fp32, dL = -(Tinv^T dTinv) Tinv^T on the strictly lower pattern, dTinv
        and the inner product rounded to bf16 as operands (dTinv through dtinv_s). The pattern compares token
        indices: a mask that did not change from item to item would be hoisted out of the loop."""
        C: gl.constexpr = dtinv.shape[0]
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        square = gl.zeros([C, C], gl.float32, layout=MMA)
        dtinv_s.store(dtinv.to(gl.bfloat16))
        fence_async_shared()
        _barrier()
        inner = warpgroup_mma(tinv_s.permute((1, 0)), dtinv_s, square, use_acc=False)
        inner = gl.convert_layout(inner.to(gl.bfloat16), DOT)
        dl = warpgroup_mma(inner, tinv_s.permute((1, 0)), square, use_acc=False)
        rows = start + gl.arange(0, C, layout=gl.SliceLayout(1, MMA))
        cols = start + gl.arange(0, C, layout=gl.SliceLayout(0, MMA))
        lower = rows[:, None] > cols[None, :]
        gc_col = _columns(gc, MMA)
        return gl.where(lower, -dl * gl.exp(gl.where(lower, gc[:, None] - gc_col, 0.0)), 0.0)

    @gluon.jit
    def _gram_grads(dme, tinv_s, dtinv_s, k_s, w_s, pk_s, beta, k_inv, eg, count, MMA: gl.constexpr):
        """backward.scalar_dl_grad on stage tiles: (db's share [C], dgc summed over the keys [C], 0 past the chunk's
        end, the l2norm backward's row dots of k and the finished partial dk [C]); by key half da = (dme k_inv_j)
        k_raw, dc = (dme beta_i k_inv_i)^T k_raw, tdw = Tinv^T dw one after the other, and dk = beta da + dc +
        beta e^gc tdw added in place to the partial dk in pk_s (rounded to bf16, as the Triton kernel stores it)."""
        C: gl.constexpr = dme.shape[0]
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        dme_k = gl.convert_layout((dme * _columns(k_inv, MMA)).to(gl.bfloat16), DOT)
        # every warp's inner product (dtinv_s's reader) is done before dme's transpose overwrites it
        _barrier()
        dtinv_s.store((dme * (beta * k_inv)[:, None]).to(gl.bfloat16))
        fence_async_shared()
        _barrier()
        half = gl.zeros([C, HALF], gl.float32, layout=MMA)
        rows = gl.arange(0, C, layout=gl.SliceLayout(1, MMA))
        db = gl.zeros([C], gl.float32, layout=gl.SliceLayout(1, MMA))
        dgc = gl.zeros([C], gl.float32, layout=gl.SliceLayout(1, MMA))
        dot = gl.zeros([C], gl.float32, layout=gl.SliceLayout(1, MMA))
        for h in gl.static_range(k_s.shape[1] // HALF):
            k_half = k_s.slice(h * HALF, HALF, dim=1)
            # one product at a time, each folded into dk's running sum as it lands: with the sum, k and dme's
            # operand, what fits the registers beside the stage's other values
            da = warpgroup_mma(dme_k, k_half, half, use_acc=False)
            k = k_half.load(MMA).to(gl.float32) * k_inv[:, None]
            db += gl.sum(da * k, 1)
            dk = beta[:, None] * da
            dc = warpgroup_mma(dtinv_s.permute((1, 0)), k_half, half, use_acc=False)
            # dgc = sum of k (beta da - dc + dkt) = sum of k dk - 2 sum of k dc, dk = beta da + dc + dkt
            dgc -= 2.0 * gl.sum(k * dc, 1)
            dk += dc
            tdw = warpgroup_mma(tinv_s.permute((1, 0)), w_s.slice(h * HALF, HALF, dim=1), half, use_acc=False)
            dk += (beta * eg)[:, None] * tdw
            dgc += gl.sum(k * dk, 1)
            pk = pk_s.slice(h * HALF, HALF, dim=1)
            dk = (dk + pk.load(MMA).to(gl.float32)).to(gl.bfloat16)
            pk.store(dk)
            # the l2norm backward's row dots of the finished partial dk, here where it is in registers
            dot += gl.sum(k * dk.to(gl.float32), 1)
        return db, gl.where(rows < count, dgc, 0.0), dot

    @gluon.jit
    def _dg_shares(dgc_ptr, start, count, head, H, NK: gl.constexpr, C: gl.constexpr):
        """state_grad's NK slots of dgc [T, H, NK + 1] for the chunk's rows, a tuple of fp32 [C] with 0 past its end,
        loaded at the item's top and summed where dg is stored: summed here, the adds would wait on the loads,
        which have the item's work to land under there."""
        SCAN: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        rows = gl.arange(0, C, layout=SCAN)
        at = dgc_ptr + ((start + rows).to(gl.int64) * H + head) * (NK + 1)
        slots = ()
        for slot in gl.static_range(NK):
            slots = slots + (gl.load(at + slot, mask=rows < count, other=0.0),)
        return slots

    @gluon.jit
    def _store_dg(dg_ptr, dgl_ptr, dgc, slots, chunk, start, count, head, H):
        """dg = dgc_last + the reverse cumsum over the chunk of dgc, each with state_grad's slots of dgc
        (_dg_shares') and of dgl [NC, H, NK] added (backward.state_dg_shares and store_dg). In a blocked layout (the
        scan does not take an MMA's slices)."""
        C: gl.constexpr = dgc.shape[0]
        NK: gl.constexpr = len(slots)
        SCAN: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        rows = gl.arange(0, C, layout=SCAN)
        total = gl.convert_layout(dgc, SCAN)
        last = 0.0
        for slot in gl.static_range(NK):
            total += slots[slot]
            last += gl.load(dgl_ptr + (chunk.to(gl.int64) * H + head) * NK + slot)
        dg = last + gl.sum(total, 0) - gl.associative_scan(total, 0, state_grad._add) + total
        gl.store(dg_ptr + (start + rows).to(gl.int64) * H + head, dg.to(dg_ptr.dtype.element_ty), mask=rows < count)

    @gluon.jit
    def _head_rows(x_ptr, start, count, head, H, C: gl.constexpr):
        """A [T, H] tensor's values [C] of a chunk's rows as loaded (state_grad._row_loads' layout), 0 past its end."""
        SCAN: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        rows = gl.arange(0, C, layout=SCAN)
        return gl.load(x_ptr + (start + rows).to(gl.int64) * H + head, mask=rows < count, other=0.0)

    @gluon.jit
    def _first_loads(tiles, tinv_desc, tinv_s, chunk_start_ptr, chunk_end_ptr, num_items, H):
        """(the item stride, the first item, its chunk's first token and token count) of the program, its first
        item's six tiles loading into the stage."""
        stride = gl.num_programs(0)
        first = gl.program_id(0)
        more = first < num_items
        first_start = gl.load(chunk_start_ptr + first // H, mask=more, other=0)
        first_count = gl.load(chunk_end_ptr + first // H, mask=more, other=0) - first_start
        if more:
            _load_values(tiles, 0, first_start, first % H)
            _load_tinv(tinv_desc, tinv_s.index(0), tiles[13].index(0), first_start, first % H)
            _load_keys(tiles, 0, first_start, first % H)
        return stride, first, first_start, first_count

    @gluon.jit
    def _walk_items(tiles, scratch, rest, L2NORM: gl.constexpr, NK: gl.constexpr):
        """Items p, p + P, .. (p the program, P programs) in the stage: the value
        products (on q, dv_new, v: the ready barrier), dq's finish (on k, dw, the partial dq: keys_ready), the key
        products, dL, the decayed Gram backward (on the partial dk: pdk_ready), dk's finish, dbeta and dg. The next
        item's q, dv_new and v load after the key products, its k, dw and partial dq after dk's finish, each part
        under this item's remaining work; Tinv and the row inputs before the wait on the stage."""
        (dvn_desc, v_desc, k_desc, w_desc, q_desc, pdq_desc, pdk_desc, dvn_s, v_s, k_s, w_s, q_s, pq_s, ready,
         keys_ready, pdk_ready) = tiles
        tinv_s, dtinv_s = scratch
        (tinv_desc, g_ptr, beta_ptr, norms_ptr, chunk_start_ptr, chunk_end_ptr, dgc_ptr, dgl_ptr, dv_ptr, dq_ptr,
         dk_ptr, db_ptr, dg_ptr, scale, num_items, H, zero) = rest
        C: gl.constexpr = q_s.shape[1]
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HALF, 16])
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        stride, first, start, count = _first_loads(tiles, tinv_desc, tinv_s, chunk_start_ptr, chunk_end_ptr, num_items,
                                                    H)
        phase = 0
        g = _head_rows(g_ptr, start, count, first % H, H, C)
        # an item's first token and count come from the item before (its next_start, next_count): loaded at the
        # item's top, the row inputs' loads would wait on them, two round trips before the first product
        for item in range(first, num_items, stride):
            # the stage's index changing with the item as far as the compiler knows (`zero` is 0): with a constant
            # one it hoists every MMA descriptor out of the loop, where they do not fit in registers (state_grad.py's
            # _consumer)
            s = item * zero
            chunk, head = item // H, item % H
            more = item + stride < num_items
            next_item = item + stride
            next_start = gl.load(chunk_start_ptr + next_item // H, mask=more, other=0)
            next_count = gl.load(chunk_end_ptr + next_item // H, mask=more, other=0) - next_start
            # the norms and beta are first read after the wait on the stage; the decay's scan would wait on g now (g
            # here is unused, its load dropped by the compiler: this item's came from the item before)
            _, k_norm, q_norm = _row_loads(g_ptr, norms_ptr, start, count, head, H, C, L2NORM)
            gc, q_scale, k_inv = _row_inputs(g, k_norm, q_norm, scale, L2NORM, ROW)
            beta = gl.convert_layout(_head_rows(beta_ptr, start, count, head, H, C), ROW).to(gl.float32)
            # the next item's g loads under this one's work (next_count is 0 where there is none)
            g = _head_rows(g_ptr, next_start, next_count, next_item % H, H, C)
            rows = gl.arange(0, C, layout=ROW)
            eg = gl.exp(gc)
            slots = _dg_shares(dgc_ptr, start, count, head, H, NK, C)
            mbarrier.wait(ready.index(s), phase)
            _mask_tinv(tinv_s.index(s), count)
            db = _value_products(tinv_s.index(s), dvn_s.index(s), v_s.index(s), beta, dv_ptr, start, count, head, H,
                                 MMA)
            mbarrier.wait(keys_ready.index(s), phase)
            q_inv = q_scale / scale
            dot = gl.zeros([C], gl.float32, layout=gl.SliceLayout(1, FINISH))
            if L2NORM:
                dot = _row_dots(q_s.index(s), pq_s.index(s), q_inv, scale)
                # the stores' pass loads the tiles again: without a barrier the compiler would keep the first
                # pass's loads (both tiles whole, in fp32) live between the passes, more than the registers hold
                _barrier()
            _finish_rows(q_s.index(s), pq_s.index(s), q_inv, scale, dot, dq_ptr, start, count, head, H, L2NORM)
            _released()
            _load_pdk(tiles, s, start, head)
            db_keys, dtinv = _key_products(tinv_s.index(s), dvn_s.index(s), v_s.index(s), k_s.index(s),
                                           w_s.index(s), beta, k_inv, eg, count, MMA)
            _released()
            if more:
                _load_values(tiles, s, next_start, next_item % H)
            dme = _decayed_dl(dtinv, tinv_s.index(s), dtinv_s.index(s), gc, start, MMA)
            mbarrier.wait(pdk_ready.index(s), phase)
            # each of the stage's three barriers completes a phase an item
            phase ^= 1
            db_gram, dgc, dot = _gram_grads(dme, tinv_s.index(s), dtinv_s.index(s), k_s.index(s), w_s.index(s),
                                       pq_s.index(s), beta, k_inv, eg, count, MMA)
            # the partial dk in pq_s was written by other threads' rows and columns; every product on Tinv is done
            _released()
            if more:
                _load_tinv(tinv_desc, tinv_s.index(s), ready.index(s), next_start, next_item % H)
            _finish_rows(k_s.index(s), pq_s.index(s), k_inv, 1.0, dot, dk_ptr, start, count, head, H, L2NORM)
            _released()
            if more:
                _load_keys(tiles, s, next_start, next_item % H)
            db_at = db_ptr + (start + rows).to(gl.int64) * H + head
            gl.store(db_at, (db + db_keys + db_gram).to(db_ptr.dtype.element_ty), mask=rows < count)
            _store_dg(dg_ptr, dgl_ptr, dgc, slots, chunk, start, count, head, H)
            start, count = next_start, next_count

    @gluon.jit
    def _allocate_stages(descs):
        """The stage of the six row tiles the first six descriptors load (dv_new, v, k, dw, q, partial dq; the
        partial dk loads into the partial dq's), bf16 [1, C, 128] each."""
        (dvn_desc, v_desc, k_desc, w_desc, q_desc, pdq_desc, pdk_desc) = descs
        C: gl.constexpr = q_desc.block_type.shape[0]
        V: gl.constexpr = v_desc.block_type.shape[1]
        K: gl.constexpr = k_desc.block_type.shape[1]
        dvn_s = gl.allocate_shared_memory(gl.bfloat16, [1, C, V], dvn_desc.layout)
        v_s = gl.allocate_shared_memory(gl.bfloat16, [1, C, V], v_desc.layout)
        k_s = gl.allocate_shared_memory(gl.bfloat16, [1, C, K], k_desc.layout)
        w_s = gl.allocate_shared_memory(gl.bfloat16, [1, C, K], w_desc.layout)
        q_s = gl.allocate_shared_memory(gl.bfloat16, [1, C, K], q_desc.layout)
        pq_s = gl.allocate_shared_memory(gl.bfloat16, [1, C, K], pdq_desc.layout)
        return dvn_s, v_s, k_s, w_s, q_s, pq_s

    @gluon.jit
    def _barriers():
        """A [1, 1] barrier (the stage's), initialized, visible to the TMA (the async proxy) and to every warp."""
        bars = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bars.index(0), count=1)
        fence_async_shared()
        _barrier()
        return bars

    @gluon.jit
    def wy_grad_kernel(dvn_desc, v_desc, k_desc, w_desc, q_desc, pdq_desc, pdk_desc, tinv_desc, g_ptr, beta_ptr,
                       norms_ptr, chunk_start_ptr, chunk_end_ptr, dgc_ptr, dgl_ptr, dv_ptr, dq_ptr, dk_ptr, db_ptr,
                       dg_ptr, scale, num_items, H, zero, L2NORM: gl.constexpr, NK: gl.constexpr,
                       num_warps: gl.constexpr):
        """backward.wy_grad_kernel's outputs (scalar decay) for num_items = NC * H items (chunk, head), persistent
        programs of one warpgroup (num_warps 4), two an SM, each walking every P-th item in a stage of its own: dv
        [T, H, V], the final dq and dk [T, H, K] (in their dtypes), dbeta [T, H] and dg [T, H]. The descriptors
        view dv_new, v as [T, H V] and k, dw, q, the partial dq and dk as [T, H K] ([C, 128] blocks, bf16); Tinv
        rows [T, H, C] bf16, g and beta [T, H], norms [T, H, 2] fp32 or None (no l2norm), dgc [T, H, NK + 1] and
        dgl [NC, H, NK] fp32 (state_grad's slots); `zero` is 0."""
        C: gl.constexpr = q_desc.block_type.shape[0]
        descs = (dvn_desc, v_desc, k_desc, w_desc, q_desc, pdq_desc, pdk_desc)
        tiles = descs + _allocate_stages(descs) + (_barriers(), _barriers(), _barriers())
        square: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, C], gl.bfloat16)
        scratch = (gl.allocate_shared_memory(gl.bfloat16, [1, C, C], tinv_desc.layout),
                   gl.allocate_shared_memory(gl.bfloat16, [1, C, C], square))
        rest = (tinv_desc, g_ptr, beta_ptr, norms_ptr, chunk_start_ptr, chunk_end_ptr, dgc_ptr, dgl_ptr, dv_ptr,
                dq_ptr, dk_ptr, db_ptr, dg_ptr, scale, num_items, H, zero)
        _walk_items(tiles, scratch, rest, L2NORM, NK)


def wy_grad(q, k, v, g, beta, tinv, dv_new, dw, part_dq, part_dk, dgc, dgl, norms, chunk_start, chunk_end, dv, dq, dk,
            dbeta, dg, scale, l2norm: bool) -> bool:
    """backward.wy_grad_kernel's outputs for the scalar decay (use_wy_grad must hold): q, k, dw, part_dq, part_dk
    [T, H, K] and v, dv_new [T, H, V] bf16, g, beta [T, H], Tinv [T, H, C] bf16, norms [T, H, 2] fp32 or None (no
    l2norm), state_grad's dgc [T, H, NK + 1] and dgl [NC, H, NK] fp32; writes dv, dq, dk, dbeta, dg (the part_dk
    scratch, which the Triton kernel updates in place, is left as it is). Returns False where the kernel does not
    compile here (nothing written)."""
    H = q.shape[1]
    num_items = dgl.shape[0] * H
    grid = (min(num_items, PROGRAMS_PER_SM * num_sms(q.device.index or 0)),)
    descs = [state_grad._rows_desc(t, t.shape[-1]) for t in (dv_new, v, k, dw, q, part_dq, part_dk, tinv)]
    return compiles("GDN wy_grad", lambda: wy_grad_kernel[grid](
        *descs, g, beta, norms, chunk_start, chunk_end, dgc, dgl, dv, dq, dk, dbeta, dg, scale, num_items, H,
        0, L2NORM=l2norm, NK=dgl.shape[-1], num_warps=4))
