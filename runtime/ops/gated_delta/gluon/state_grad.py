"""backward.state_grad_kernel in Gluon for Hopper (sm_90), GDN's (scalar decay, state_grad_kernel) and KDA's
(per-channel decay, channel_state_grad_kernel): the same inputs, the same outputs into the same buffers, run in its
place where `use_state_grad` says the shapes allow.

Why Gluon: the Triton kernel (a program per chunk, key block of 32 and head; three 4-warp programs an SM) is
latency-bound: each program waits on its own loads, then computes, and no program an SM keeps enough bytes in
flight. Here persistent programs walk the work items (chunk,
head, key half), each item in a stage of shared memory (96 KB) that a warpgroup TMA-loads its next item's tiles into
in three parts, each as soon as this item's last reader of it is done (do, v_new, dh after the first products, dv_new
and h after dw's, q and k after dgc), so that one warpgroup's loads stay in flight while it finishes its tail and
while the other warpgroup of the SM computes. GDN's kernel runs two programs of one warpgroup an SM, each its own
stage; KDA's one program of two warpgroups (warp_specialize), each every other item of the program in a stage of its
own. Two programs run one copy of the loop where two warpgroups of one program run two, and the instruction fetch of
two copies of a long loop is what stalled the warp-specialized wy_grad (wy_representation_grad.py). No producer
partition: with a stage per warpgroup it would issue the same loads at the same points, and its warps would take
registers the consumers need (they use nearly all a thread may have).
An item's first token and count come from the item before, and its rows' g and norms are loaded under the item before
(the next item's): loaded at the item's top, they were a chain of three round trips (chunk bounds, then the rows,
then the scan) that the warps waited on.

Work item (chunk, head, key half of KH = 64 keys), its tiles in one stage, all bf16:
  do, v_new, dv_new [C, V] (rows of the chunk; both halves of a chunk and head read them, neighbouring programs at
  the same time, so the second from L2), h, dh [KH, V] (the key half of the states), q, k [C, KH] (the raw inputs).
Products (warpgroup MMAs, fp32 accumulators [C, KH]): dqg = do h^T, dkbar = v_new dh^T, dP = do v_new^T, then the
tail: dq = dqg e^gc + dme k, dk = dkbar e^(gc_last - gc) + dme^T q, then dw = -dv_new h^T (its accumulator once the
tail's products are done: fewer registers live at once), dgc = q dq - k dk, dgc_last; dlam = sum over V of h dh from
shared memory while the first products run.
The tail's two products (dme k, dme^T q) take tf32 operands in the Triton kernel (PREC); tf32 operands would have
to sit in shared memory in fp32 and K-major, where there is no room beside the stages. Here the rows' scales (the
l2norm's and `scale`) are folded into dme, so that q and k enter exactly as stored (bf16), and dme goes in as two bf16
parts hi + lo (~16 bits, finer than tf32's 11): two products each instead of one, small ones ([C, C] x [C, KH]).
A single bf16 dme would add ~2e-3 relative RMS to the partial dq and dk (a CPU model of this kernel against the
Triton kernel: 1.4e-3 and 2.7e-3; with hi + lo 7e-5 and 9e-5). The other products take bf16 operands as the Triton
kernel's (DOTS "bf16").

KDA's kernel walks the same items in the same stages with the same three-part loads; its tail has no dme products
(gram_grad_kernel takes the decayed Gram backward), so no dme tiles in shared memory. Its decay g [C, KH] is loaded
with gl.load and scanned down the rows (a warp's lanes) before the wait on the stage, gc stored from MMA's layout; dq =
dqg e^gc, dk = dkbar e^(gc_last - gc), dgc = q dq - k dk and dgc_last = sum over rows of k dk + e^gc_last dlam
are per key. dP (do v_new^T, masked causal, fp32) goes to gram_grad_kernel (dpfull, its S x S diagonal blocks
dpdiag): each key half of a chunk and head computes and stores half of its columns (a [C, C / 2] product on its
half of v_new's rows), so that both halves do the same work; computing it in one half only would give programs
whose items all fall on that half (an even number of programs and two warpgroups: item parity fixed per program)
all of it.

Rows past a chunk's end: TMA reads them (the next chunk's tokens, or zeros past T); the tail zeroes dP's and dk's
rows there (what the Triton kernel gets from its masked loads) and the stores skip them.

Gluon has no CPU interpreter: tests compile the kernel for sm_90a on any machine, check a torch model of its
algorithm against the Triton kernel, and compare the kernel itself with the Triton kernel where a Hopper GPU is; the
Triton kernel stays the path everywhere else.

Shape legend: T tokens, H heads, K key dim, V value dim, C chunk size, NC chunks, NK key blocks of the Triton kernel
(its dgc and dgl slots), KH = 64 keys an item (a key half).
"""
from __future__ import annotations

import torch

from runtime.ops.common.gluon_fallback import compiles, num_sms
from runtime.ops.gated_delta.backend import SELECTOR

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a triton without Gluon's Hopper modules: function.py keeps the Triton kernel
    gluon = None

# the shapes the tiles are written for
CHUNK, KEY_DIM, VALUE_DIM, KEYS_PER_ITEM = 64, 128, 128, 64
# the worker warpgroup's registers a thread, as the other's (256 x 256 threads: the register file); fewer do not
# hold the loop's live values
WORKER_REGS = 256
SHARED_BYTES = 227 * 1024
# GDN's kernel: programs of one warpgroup an SM, each its own stage (one copy of the loop: wy_representation_grad.py's
# reasoning)
PROGRAMS_PER_SM = 2


def state_grad_fits(K: int, V: int, C: int, key_block: int, dtype: torch.dtype, per_channel: bool) -> bool:
    """Whether the kernels' tiles take these shapes: bf16 storage, K = V = 128, C = 64, and for GDN the Triton
    kernel's key blocks (the slots of dgc and dgl) the halves of an item's 64 keys (KDA's dgc and dgl are per key,
    no slots)."""
    return (dtype == torch.bfloat16 and K == KEY_DIM and V == VALUE_DIM and C == CHUNK
            and (per_channel or 2 * key_block == KEYS_PER_ITEM))


def use_state_grad(q_THK: torch.Tensor, h: torch.Tensor, C: int, key_block: int, per_channel: bool) -> bool:
    """A Hopper GPU runs the tensors, this triton has Gluon, and state_grad_fits."""
    return (gluon is not None and q_THK.is_cuda and SELECTOR.choose(q_THK.device) == "hopper" and q_THK.dtype == h.dtype
            and state_grad_fits(q_THK.shape[-1], h.shape[-1], C, key_block, h.dtype, per_channel))


if gluon is not None:
    # triton 3.6 calls these tma.async_copy_global_to_shared and thread_barrier, 3.7 and later async_load and barrier
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _item(item, H):
        """(chunk, head, key half) of a work item: the two halves of one chunk and head are neighbours, so that
        neighbouring programs run them together and the second reads do, v_new and dv_new from L2."""
        return item // (2 * H), (item // 2) % H, item % 2

    @gluon.jit
    def _item_rows(item, stride, num_items, chunk_start_ptr, chunk_end_ptr, H):
        """(chunk, head, key half, whether the warpgroup has a next item, that item's first token and token count or
        0) of a work item. An item's own first token and count come from the item before (the consumers carry
        them): loaded at the item's top, its row inputs' loads would wait on them, two round trips in a row."""
        chunk, head, half = _item(item, H)
        more = item + stride < num_items
        next_chunk = _item(item + stride, H)[0]
        next_start = gl.load(chunk_start_ptr + next_chunk, mask=more, other=0)
        next_count = gl.load(chunk_end_ptr + next_chunk, mask=more, other=0) - next_start
        return chunk, head, half, more, next_start, next_count

    @gluon.jit
    def _load_products(tiles, stage, bar, item, start, H):
        """TMA of the tiles that only the first products read (do, v_new, dh's key half) of an item (its chunk's first
        token `start`) into stage `stage`, its full barrier expecting all the item's bytes (_load_dw's, _load_keys')."""
        (do_desc, vnew_desc, dvnew_desc, h_desc, dh_desc, q_desc, k_desc, do_s, vnew_s, dvnew_s, h_s, dh_s, q_s, k_s,
         full) = tiles
        C: gl.constexpr = do_s.shape[1]
        V: gl.constexpr = do_s.shape[2]
        KH: gl.constexpr = q_s.shape[2]
        chunk, head, half = _item(item, H)
        mbarrier.expect(bar, 2 * (3 * C * V + 2 * KH * V + 2 * C * KH))
        _tma_load(do_desc, [start, head * V], bar, do_s.index(stage))
        _tma_load(vnew_desc, [start, head * V], bar, vnew_s.index(stage))
        _tma_load(dh_desc, [(chunk * H + head) * (2 * KH) + half * KH, 0], bar, dh_s.index(stage))

    @gluon.jit
    def _load_dw(tiles, stage, bar, item, start, H):
        """TMA of an item's dv_new and h's key half (dw's operands; h is dqg's too) into stage `stage`."""
        (do_desc, vnew_desc, dvnew_desc, h_desc, dh_desc, q_desc, k_desc, do_s, vnew_s, dvnew_s, h_s, dh_s, q_s, k_s,
         full) = tiles
        V: gl.constexpr = do_s.shape[2]
        KH: gl.constexpr = q_s.shape[2]
        chunk, head, half = _item(item, H)
        _tma_load(dvnew_desc, [start, head * V], bar, dvnew_s.index(stage))
        _tma_load(h_desc, [(chunk * H + head) * (2 * KH) + half * KH, 0], bar, h_s.index(stage))

    @gluon.jit
    def _load_keys(tiles, stage, bar, item, start, H):
        """TMA of an item's q and k key half into stage `stage` (its full barrier already expects them)."""
        (do_desc, vnew_desc, dvnew_desc, h_desc, dh_desc, q_desc, k_desc, do_s, vnew_s, dvnew_s, h_s, dh_s, q_s, k_s,
         full) = tiles
        KH: gl.constexpr = q_s.shape[2]
        chunk, head, half = _item(item, H)
        key_col = head * (2 * KH) + half * KH
        _tma_load(q_desc, [start, key_col], bar, q_s.index(stage))
        _tma_load(k_desc, [start, key_col], bar, k_s.index(stage))

    @gluon.jit
    def _released():
        """Every thread of the warpgroup is past its reads of the stage, ordered before the TMA's writes (the async
        proxy) into it."""
        _barrier()
        fence_async_shared()

    @gluon.jit
    def _row_dot_vector(a_s, b_s, LOAD: gl.constexpr):
        """sum over columns of a * b for two [R, V] bf16 tiles in shared memory, fp32 [R] in LOAD's row slice, 32
        columns at a time: few registers beside the accumulators of the products in flight."""
        R: gl.constexpr = a_s.shape[0]
        acc = gl.zeros([R], gl.float32, layout=gl.SliceLayout(1, LOAD))
        for c in gl.static_range(a_s.shape[1] // 32):
            a = a_s.slice(c * 32, 32, dim=1).load(LOAD).to(gl.float32)
            b = b_s.slice(c * 32, 32, dim=1).load(LOAD).to(gl.float32)
            acc += gl.sum(a * b, axis=1)
        return acc

    @gluon.jit
    def _row_dots(a_s, b_s):
        """_row_dot_vector summed again over the first and the second half of the rows (two scalars)."""
        R: gl.constexpr = a_s.shape[0]
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        return _half_sums(_row_dot_vector(a_s, b_s, LOAD), R // 2, gl.SliceLayout(1, LOAD))

    @gluon.jit
    def _products(do, vnew, h, dh, MMA: gl.constexpr):
        """(dqg, dkbar, dP, dlam) of one stage: the three MMAs in flight while dlam = sum over V of h dh is summed
        from shared memory, over each key block of the Triton kernel (dgc_last's slots are sums over them)."""
        C: gl.constexpr = do.shape[0]
        KH: gl.constexpr = h.shape[0]
        zero = gl.zeros([C, KH], gl.float32, layout=MMA)
        dqg = warpgroup_mma(do, h.permute((1, 0)), zero, use_acc=False, is_async=True)
        dkbar = warpgroup_mma(vnew, dh.permute((1, 0)), zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do, vnew.permute((1, 0)), zero, use_acc=False, is_async=True)
        dlam = _row_dots(h, dh)
        dqg, dkbar, dp = warpgroup_mma_wait(num_outstanding=0, deps=(dqg, dkbar, dp))
        return dqg, dkbar, dp, dlam

    @gluon.jit
    def _store_rows(ptr, x, start, count, head, col0, H, D: gl.constexpr, LAYOUT: gl.constexpr):
        """x [C, cols] in LAYOUT into columns col0.. of rows start.. start + count - 1 of a packed [T, H, D] tensor,
        in its dtype. A pointer a row plus the columns: in-tile offsets alone would not change from item to item, and
        the compiler would hoist them out of the loop into registers."""
        rows = gl.arange(0, x.shape[0], layout=gl.SliceLayout(1, LAYOUT))
        cols = gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, LAYOUT))
        row_ptrs = ptr + ((start + rows).to(gl.int64) * H + head) * D + col0
        gl.store(row_ptrs[:, None] + cols[None, :], x.to(ptr.dtype.element_ty), mask=(rows < count)[:, None])

    @gluon.jit
    def _store_rows_through(ptr, x, buf, start, count, head, col0, H, D: gl.constexpr):
        """_store_rows of x [C, KH] (an accumulator) through the bf16 tile buf in shared memory: from the
        accumulator's layout a warp's store writes 8 rows x 16 bytes (half of each 32-byte sector), read back a row's
        8 bf16 a thread, a warp's writes 4 whole rows of 128 bytes. The caller orders buf's earlier readers before."""
        buf.store(x.to(buf.dtype))
        _barrier()
        ROWS: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        _store_rows(ptr, buf.load(ROWS), start, count, head, col0, H, D, ROWS)

    @gluon.jit
    def _store_rows_converted(ptr, x, start, count, head, col0, H, D: gl.constexpr):
        """_store_rows of x [C, KH] (an accumulator) into a bf16 tensor by way of convert_layout's shared scratch
        (its [C, KH] bf16 fits in the per-channel kernel's shared memory, not in GDN's: there _store_rows_through),
        for the same 128-byte rows a warp's store."""
        ROWS: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        _store_rows(ptr, gl.convert_layout(x.to(ptr.dtype.element_ty), ROWS), start, count, head, col0, H, D, ROWS)

    @gluon.jit
    def _row_loads(g_ptr, norms_ptr, start, count, head, H, C: gl.constexpr, L2NORM: gl.constexpr):
        """(g, k's and q's inverse norms) of a chunk's rows as loaded, [C] in a blocked layout, 0 past its end (the
        norms 1 without the l2norm). Issued for the next item under this one's work: _row_inputs finishes them."""
        SCAN: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        rows = gl.arange(0, C, layout=SCAN)
        valid = rows < count
        tok = (start + rows).to(gl.int64) * H + head
        g = gl.load(g_ptr + tok, mask=valid, other=0.0)
        if L2NORM:
            k_inv = gl.load(norms_ptr + tok * 2, mask=valid, other=0.0)
            q_inv = gl.load(norms_ptr + tok * 2 + 1, mask=valid, other=0.0)
        else:
            k_inv = gl.full([C], 1.0, gl.float32, layout=SCAN)
            q_inv = k_inv
        return g, k_inv, q_inv

    @gluon.jit
    def _row_inputs(g, k_inv, q_inv, scale, L2NORM: gl.constexpr, ROW: gl.constexpr):
        """(gc in-chunk cumulative log decay, q's and k's row scales) fp32 [C] in layout ROW from _row_loads' rows.
        The scan runs in their blocked layout (not one of an MMA's slices, which triton's scan does not take)."""
        gc = gl.convert_layout(gl.associative_scan(g.to(gl.float32), 0, _add), ROW)
        if L2NORM:
            q_scale = gl.convert_layout(q_inv, ROW)
            k_scale = gl.convert_layout(k_inv, ROW)
        else:
            q_scale = gl.full([g.shape[0]], 1.0, gl.float32, layout=ROW) * scale
            k_scale = gl.full([g.shape[0]], 1.0, gl.float32, layout=ROW)
        return gc, q_scale, k_scale

    @gluon.jit
    def _row_scales(norms_ptr, tok, valid, scale, C: gl.constexpr, L2NORM: gl.constexpr, ROW: gl.constexpr):
        """(q's, k's row scales) fp32 [C] in layout ROW of rows tok (token * H + head): the inverse norms prep stored
        [T, H, 2] (q's times `scale`), or `scale` and 1 without the l2norm; 0 where not valid."""
        if L2NORM:
            k_scale = gl.load(norms_ptr + tok * 2, mask=valid, other=0.0)
            q_scale = gl.load(norms_ptr + tok * 2 + 1, mask=valid, other=0.0)
        else:
            k_scale = gl.full([C], 1.0, gl.float32, layout=ROW)
            q_scale = gl.full([C], 1.0, gl.float32, layout=ROW) * scale
        return q_scale, k_scale

    @gluon.jit
    def _decayed_dp(dp, gc, start, count, MMA: gl.constexpr):
        """dme = dP_ij e^(gc_i - gc_j) on the causal pattern of the chunk's rows, 0 elsewhere and past its end. The
        pattern compares token indices, not in-chunk ones: a mask that did not change from item to item would be
        hoisted out of the loop into registers."""
        C: gl.constexpr = dp.shape[0]
        rows = start + gl.arange(0, C, layout=gl.SliceLayout(1, MMA))
        cols = start + gl.arange(0, C, layout=gl.SliceLayout(0, MMA))
        keep = (rows[:, None] >= cols[None, :]) & (rows < start + count)[:, None]
        gc_col = gl.convert_layout(gc, gl.SliceLayout(0, MMA))
        return gl.where(keep, dp * gl.exp(gl.where(keep, gc[:, None] - gc_col[None, :], 0.0)), 0.0)

    @gluon.jit
    def _half_sums(x, SLOT: gl.constexpr, LAYOUT: gl.constexpr):
        """(sum of x's first SLOT entries, of the next SLOT) of a vector of 2 SLOT in LAYOUT."""
        cols = gl.arange(0, 2 * SLOT, layout=LAYOUT)
        return gl.sum(gl.where(cols < SLOT, x, 0.0), 0), gl.sum(gl.where(cols >= SLOT, x, 0.0), 0)

    @gluon.jit
    def _column_halves(x, MMA: gl.constexpr):
        """(sums over the first and the second half of the columns of x) by row: within a quad of threads."""
        cols = gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, MMA))
        first = gl.sum(gl.where((cols < x.shape[1] // 2)[None, :], x, 0.0), 1)
        return first, gl.sum(gl.where((cols >= x.shape[1] // 2)[None, :], x, 0.0), 1)

    @gluon.jit
    def _block_sums(x, MMA: gl.constexpr):
        """The sums of x [R, KH] over each half of its columns (two scalars): the rows reduced last, as two scalars
        across the warps."""
        first, second = _column_halves(x, MMA)
        return gl.sum(first, 0), gl.sum(second, 0)

    @gluon.jit
    def _store_dgc(dgc_ptr, dgc, start, count, head, half, H, NK: gl.constexpr, MMA: gl.constexpr):
        """dgc's row sums over each of the item's two key blocks of the Triton kernel, into their slots of
        [T, H, NK + 1]."""
        rows = gl.arange(0, dgc.shape[0], layout=gl.SliceLayout(1, MMA))
        first, second = _column_halves(dgc, MMA)
        at = dgc_ptr + ((start + rows).to(gl.int64) * H + head) * (NK + 1) + half * 2
        gl.store(at, first, mask=rows < count)
        gl.store(at + 1, second, mask=rows < count)

    @gluon.jit
    def _scaled(x_s, scale_R, MMA: gl.constexpr):
        """x [R, KH] from shared memory in fp32, row r times scale_R[r]."""
        return x_s.load(MMA).to(gl.float32) * scale_R[:, None]

    @gluon.jit
    def _split_bf16(x):
        """(hi, lo) bf16 with hi + lo = x to ~16 bits: two bf16 products carry x as finely as tf32 would."""
        hi = x.to(gl.bfloat16)
        return hi, (x - hi.to(gl.float32)).to(gl.bfloat16)

    @gluon.jit
    def _tail(dqg, dkbar, dp, dlam, q_s, k_s, dvnew_s, h_s, dmet_hi, dmet_lo, gc, q_scale, k_scale, start, count,
              MMA: gl.constexpr):
        """(dq, dk, dw without its sign, dgc_last's key-block sums) of an item from its products
        (backward.state_grad_kernel's tail), then dw's product; q_s and k_s hold the raw q and k, dmet_hi and
        dmet_lo take the two bf16 parts of dme's transpose for dk's products."""
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        COL: gl.constexpr = gl.SliceLayout(0, MMA)
        C: gl.constexpr = dp.shape[0]
        rows = gl.arange(0, C, layout=ROW)
        last = gl.sum(gl.where(rows == C - 1, gc, 0.0), 0)
        dq = dqg * gl.exp(gc)[:, None]
        dk = gl.where((rows < count)[:, None], dkbar * gl.exp(last - gc)[:, None], 0.0)
        # q and k are read from shared memory where used, not held across the products
        first, second = _block_sums(_scaled(k_s, k_scale, MMA) * dk, MMA)
        dgl = (first + gl.exp(last) * dlam[0], second + gl.exp(last) * dlam[1])
        dme = _decayed_dp(dp, gc, start, count, MMA)
        # the rows' scales go into dme: q and k enter the products as stored; dme k with k's scale by column of dme
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        dme_k_hi, dme_k_lo = _split_bf16(dme * gl.convert_layout(k_scale, COL)[None, :])
        dme_k_hi = gl.convert_layout(dme_k_hi, DOT)
        dme_k_lo = gl.convert_layout(dme_k_lo, DOT)
        dq = warpgroup_mma(dme_k_hi, k_s, dq, is_async=True)
        dq = warpgroup_mma(dme_k_lo, k_s, dq, is_async=True)
        dme_q_hi, dme_q_lo = _split_bf16(dme * q_scale[:, None])
        dmet_hi.store(dme_q_hi)
        dmet_lo.store(dme_q_lo)
        fence_async_shared()
        _barrier()
        dk = warpgroup_mma(dmet_hi.permute((1, 0)), q_s, dk, is_async=True)
        dk = warpgroup_mma(dmet_lo.permute((1, 0)), q_s, dk, is_async=True)
        dq, dk, dme_k_hi, dme_k_lo = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dk, dme_k_hi, dme_k_lo))
        # dw's accumulator after dme's halves are free
        dw = warpgroup_mma(dvnew_s, h_s.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=MMA), use_acc=False)
        return dq, dk, dw, dgl

    @gluon.jit
    def _first_loads(tiles, chunk_start_ptr, chunk_end_ptr, num_items, H, FIRST: gl.constexpr, STEP: gl.constexpr):
        """(stage FIRST's full barrier, the item stride, the first item, its chunk's first token and token count) of
        a consumer, its first item's tiles loading."""
        bar = tiles[-1].index(FIRST)
        stride = STEP * gl.num_programs(0)
        first = gl.program_id(0) + FIRST * gl.num_programs(0)
        more = first < num_items
        first_start = gl.load(chunk_start_ptr + _item(first, H)[0], mask=more, other=0)
        first_count = gl.load(chunk_end_ptr + _item(first, H)[0], mask=more, other=0) - first_start
        if more:
            _load_products(tiles, FIRST, bar, first, first_start, H)
            _load_dw(tiles, FIRST, bar, first, first_start, H)
            _load_keys(tiles, FIRST, bar, first, first_start, H)
        return bar, stride, first, first_start, first_count

    @gluon.jit
    def _consumer(tiles, dmet_s, rest, L2NORM: gl.constexpr, NK: gl.constexpr, FIRST: gl.constexpr,
                  STEP: gl.constexpr):
        """Items p + FIRST P, p + (FIRST + STEP) P, .. (p the program, P programs) in stage FIRST: products, tail,
        stores. The next item's tiles go out as soon as this one's last reader is done with them: do, v_new and dh after
        the first products, dv_new and h after dw's, q and k after dgc; its first token, count and rows (g, the norms)
        load at this item's top, under its work."""
        (do_desc, vnew_desc, dvnew_desc, h_desc, dh_desc, q_desc, k_desc, do_s, vnew_s, dvnew_s, h_s, dh_s, q_s, k_s,
         full) = tiles
        (g_ptr, norms_ptr, chunk_start_ptr, chunk_end_ptr, dq_ptr, dk_ptr, dw_ptr, dgc_ptr, dgl_ptr, scale, num_items,
         H, zero) = rest
        C: gl.constexpr = do_s.shape[1]
        KH: gl.constexpr = q_s.shape[2]
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, KH, 16])
        bar, stride, first, start, count = _first_loads(tiles, chunk_start_ptr, chunk_end_ptr, num_items, H, FIRST,
                                                             STEP)
        phase = 0
        g, k_inv, q_inv = _row_loads(g_ptr, norms_ptr, start, count, _item(first, H)[1], H, C, L2NORM)
        for item in range(first, num_items, stride):
            # the stage's index changing with the item as far as the compiler knows (`zero` is 0): with a constant
            # one it hoists every MMA descriptor out of the loop, where they do not fit in registers
            s = FIRST + item * zero
            chunk, head, half, more, next_start, next_count = _item_rows(item, stride, num_items, chunk_start_ptr,
                                                                         chunk_end_ptr, H)
            gc, q_scale, k_scale = _row_inputs(g, k_inv, q_inv, scale, L2NORM, gl.SliceLayout(1, MMA))
            # the next item's rows load under this one's work (next_count is 0 where there is none)
            g, k_inv, q_inv = _row_loads(g_ptr, norms_ptr, next_start, next_count, _item(item + stride, H)[1], H, C,
                                         L2NORM)
            mbarrier.wait(bar, phase)
            phase ^= 1
            dqg, dkbar, dp, dlam = _products(do_s.index(s), vnew_s.index(s), h_s.index(s), dh_s.index(s), MMA)
            _released()
            if more:
                _load_products(tiles, s, bar, item + stride, next_start, H)
            dq, dk, dw, dgl = _tail(dqg, dkbar, dp, dlam, q_s.index(s), k_s.index(s), dvnew_s.index(s), h_s.index(s),
                                    dmet_s.index(2 * s), dmet_s.index(2 * s + 1), gc, q_scale, k_scale, start,
                                    count, MMA)
            _released()
            if more:
                _load_dw(tiles, s, bar, item + stride, next_start, H)
            col0 = half * KH
            # dw out first: its registers are free before q and k come in for dgc. From the accumulator's layout:
            # through a shared tile here the loop runs out of registers without the l2norm
            _store_rows(dw_ptr, -dw, start, count, head, col0, H, 2 * KH, MMA)
            dgc = _scaled(q_s.index(s), q_scale, MMA) * dq - _scaled(k_s.index(s), k_scale, MMA) * dk
            _released()
            if more:
                _load_keys(tiles, s, bar, item + stride, next_start, H)
            # dq and dk through dme's two tiles, free after the tail's products (the next item's tail writes them
            # after its stage's barriers)
            dmet_hi, dmet_lo = dmet_s.index(2 * s), dmet_s.index(2 * s + 1)
            _store_rows_through(dq_ptr, dq, dmet_lo, start, count, head, col0, H, 2 * KH)
            _store_rows_through(dk_ptr, dk, dmet_hi, start, count, head, col0, H, 2 * KH)
            _store_dgc(dgc_ptr, dgc, start, count, head, half, H, NK, MMA)
            at = dgl_ptr + (chunk.to(gl.int64) * H + head) * NK + half * 2
            gl.store(at, dgl[0])
            gl.store(at + 1, dgl[1])
            start, count = next_start, next_count

    @gluon.jit
    def state_grad_kernel(do_desc, vnew_desc, dvnew_desc, h_desc, dh_desc, q_desc, k_desc, g_ptr, norms_ptr,
                          chunk_start_ptr, chunk_end_ptr, dq_ptr, dk_ptr, dw_ptr, dgc_ptr, dgl_ptr, scale, num_items,
                          H, zero, L2NORM: gl.constexpr, NK: gl.constexpr, num_warps: gl.constexpr):
        """backward.state_grad_kernel's outputs (scalar decay) for num_items = NC * H * 2 items (chunk, head, key
        half), persistent programs of one warpgroup (num_warps 4), PROGRAMS_PER_SM an SM, each walking every P-th item
        (P programs) in a stage of its own: dq, dk, dw (stored, bf16 [T, H, K]), dgc's row sums in slots
        of [T, H, NK + 1] and dgc_last's sums in slots of [NC, H, NK] (fp32, NK = K / 32 as the Triton kernel's key
        blocks). The descriptors view do, v_new, dv_new as [T, H V], q, k as [T, H K] and h, dh as [NC H K, V];
        `zero` is 0."""
        C: gl.constexpr = do_desc.block_type.shape[0]
        descs = (do_desc, vnew_desc, dvnew_desc, h_desc, dh_desc, q_desc, k_desc)
        stages = _allocate_stages(descs, 1)
        dmet_s = gl.allocate_shared_memory(gl.bfloat16, [2, C, C], q_desc.layout)
        tiles = descs + stages + (_full_barriers(1),)
        rest = (g_ptr, norms_ptr, chunk_start_ptr, chunk_end_ptr, dq_ptr, dk_ptr, dw_ptr, dgc_ptr, dgl_ptr, scale,
                num_items, H, zero)
        _consumer(tiles, dmet_s, rest, L2NORM, NK, 0, 1)

    @gluon.jit
    def _allocate_stages(descs, NUM: gl.constexpr):
        """The two stages of the tiles the descriptors (do, v_new, dv_new, h, dh, q, k) load, bf16: [2, C, V] for
        the rows, [2, KH, V] for the states, [2, C, KH] for the keys."""
        (do_desc, vnew_desc, dvnew_desc, h_desc, dh_desc, q_desc, k_desc) = descs
        C: gl.constexpr = do_desc.block_type.shape[0]
        V: gl.constexpr = do_desc.block_type.shape[1]
        KH: gl.constexpr = q_desc.block_type.shape[1]
        do_s = gl.allocate_shared_memory(gl.bfloat16, [NUM, C, V], do_desc.layout)
        vnew_s = gl.allocate_shared_memory(gl.bfloat16, [NUM, C, V], vnew_desc.layout)
        dvnew_s = gl.allocate_shared_memory(gl.bfloat16, [NUM, C, V], dvnew_desc.layout)
        h_s = gl.allocate_shared_memory(gl.bfloat16, [NUM, KH, V], h_desc.layout)
        dh_s = gl.allocate_shared_memory(gl.bfloat16, [NUM, KH, V], dh_desc.layout)
        q_s = gl.allocate_shared_memory(gl.bfloat16, [NUM, C, KH], q_desc.layout)
        k_s = gl.allocate_shared_memory(gl.bfloat16, [NUM, C, KH], k_desc.layout)
        return do_s, vnew_s, dvnew_s, h_s, dh_s, q_s, k_s

    @gluon.jit
    def _full_barriers(NUM: gl.constexpr):
        """The stages' full barriers [NUM, 1], initialized, visible to the TMA (the async proxy) and to every warp."""
        full = gl.allocate_shared_memory(gl.int64, [NUM, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM):
            mbarrier.init(full.index(s), count=1)
        fence_async_shared()
        _barrier()
        return full

    @gluon.jit
    def _channel_decay(g_ptr, gcs_ptr, start, count, head, col0, H, K: gl.constexpr, C: gl.constexpr,
                       KH: gl.constexpr, MMA: gl.constexpr):
        """(gc [C, KH] in MMA, its last row gc_last [KH] in MMA's column slice) fp32 of the item's keys col0..: the
        in-chunk cumulative sum down the rows of the per-channel log decay g [T, H, K], 0 past the chunk's end as the
        Triton kernel's masked loads give (gc_last is the chunk's last row's); gc goes into gcs [T, H, K] from MMA's
        layout. The scan runs along a warp's lanes (rows), each thread holding 16 neighbouring columns of two
        rows: one 32-byte load a row, no shared memory in the scan."""
        SCAN: gl.constexpr = gl.BlockedLayout([1, KH // gl.num_warps()], [32, 1], [1, gl.num_warps()], [1, 0])
        rows = gl.arange(0, C, layout=gl.SliceLayout(1, SCAN))
        cols = gl.arange(0, KH, layout=gl.SliceLayout(0, SCAN))
        at = g_ptr + ((start + rows).to(gl.int64) * H + head) * K + col0
        g = gl.load(at[:, None] + cols[None, :], mask=(rows < count)[:, None], other=0.0)
        gc = gl.associative_scan(g.to(gl.float32), 0, _add)
        last = gl.sum(gl.where((rows == C - 1)[:, None], gc, 0.0), 0)
        gc_mma = gl.convert_layout(gc, MMA)
        # stored from MMA, a row's 32-byte sector a quad of threads (the scan's layout writes half sectors)
        _store_rows(gcs_ptr, gc_mma, start, count, head, col0, H, K, MMA)
        return gc_mma, gl.convert_layout(last, gl.SliceLayout(0, MMA))

    @gluon.jit
    def _channel_products(do, vnew, h, dh, half, MMA: gl.constexpr, DP: gl.constexpr):
        """(dqg, dkbar [C, KH], dP's columns of key half `half` [C, C / 2] in DP, dlam [KH] in MMA's column slice) of
        one stage: dqg's and dkbar's MMAs in flight while dlam = sum over V of h dh is summed from shared memory, then
        dP's on the half's rows of v_new. The two key halves of a chunk and head compute a half of dP's columns each:
        the same work in both, whatever halves a program's items fall on. The rows are picked by a branch, not by a
        view at a run-time offset: a tile's 64-column blocks are its outermost in shared memory (the NVMMA swizzle),
        so its half of the rows is not one contiguous block."""
        C: gl.constexpr = do.shape[0]
        KH: gl.constexpr = h.shape[0]
        zero = gl.zeros([C, KH], gl.float32, layout=MMA)
        dqg = warpgroup_mma(do, h.permute((1, 0)), zero, use_acc=False, is_async=True)
        dkbar = warpgroup_mma(vnew, dh.permute((1, 0)), zero, use_acc=False, is_async=True)
        dlam = _row_dot_vector(h, dh, gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0]))
        dp = gl.zeros([C, C // 2], gl.float32, layout=DP)
        # each synchronous: waits for dqg's and dkbar's too
        if half == 0:
            dp = warpgroup_mma(do, vnew.slice(0, C // 2).permute((1, 0)), dp, use_acc=False)
        else:
            dp = warpgroup_mma(do, vnew.slice(C // 2, C // 2).permute((1, 0)), dp, use_acc=False)
        dqg, dkbar = warpgroup_mma_wait(num_outstanding=0, deps=(dqg, dkbar))
        return dqg, dkbar, dp, gl.convert_layout(dlam, gl.SliceLayout(0, MMA))

    @gluon.jit
    def _store_dp(dpdiag_ptr, dpfull_ptr, dp, start, count, head, col0, H, S: gl.constexpr, DP: gl.constexpr):
        """dP's columns col0.. [C, C / 2] of the chunk on the causal pattern (0 above the diagonal) into dpfull rows
        [T, H, C] and their part of the S x S diagonal blocks into dpdiag rows [T, H, S], fp32, the chunk's rows
        only. The pattern compares token indices: a mask that did not change from item to item would be hoisted out
        of the loop into registers."""
        C: gl.constexpr = dp.shape[0]
        rows = gl.arange(0, C, layout=gl.SliceLayout(1, DP))
        cols = col0 + gl.arange(0, dp.shape[1], layout=gl.SliceLayout(0, DP))
        dp = gl.where((start + rows)[:, None] >= (start + cols)[None, :], dp, 0.0)
        _store_rows(dpfull_ptr, dp, start, count, head, col0, H, C, DP)
        diag = ((rows // S)[:, None] == (cols // S)[None, :]) & (rows < count)[:, None]
        at = dpdiag_ptr + ((start + rows).to(gl.int64) * H + head) * S
        gl.store(at[:, None] + (cols % S)[None, :], dp, mask=diag)

    @gluon.jit
    def _channel_tail(dqg, dkbar, dlam, gc, gc_last, k_s, dvnew_s, h_s, k_scale, count, MMA: gl.constexpr):
        """(dq, dk, dw without its sign, dgl [KH]) of a per-channel item (backward.state_grad_kernel's tail, no
        decayed Gram products: gram_grad_kernel's): dq = dqg e^gc, dk = dkbar e^(gc_last - gc), 0 past the chunk's
        end (TMA read the next chunk's rows there), dgl = sum over rows of k dk + e^gc_last dlam; then dw's
        product."""
        C: gl.constexpr = dqg.shape[0]
        rows = gl.arange(0, C, layout=gl.SliceLayout(1, MMA))
        dq = dqg * gl.exp(gc)
        dk = gl.where((rows < count)[:, None], dkbar * gl.exp(gc_last[None, :] - gc), 0.0)
        dgl = gl.sum(_scaled(k_s, k_scale, MMA) * dk, 0) + gl.exp(gc_last) * dlam
        dw = warpgroup_mma(dvnew_s, h_s.permute((1, 0)), gl.zeros(dqg.shape, gl.float32, layout=MMA), use_acc=False)
        return dq, dk, dw, dgl

    @gluon.jit
    def _channel_consumer(tiles, rest, L2NORM: gl.constexpr, S: gl.constexpr, FIRST: gl.constexpr,
                          STEP: gl.constexpr):
        """_consumer's walk for the per-channel decay: items p + FIRST P, p + (FIRST + STEP) P, .. in stage FIRST,
        the next item's tiles loading in the same three parts after their last readers; the decay's scan and the
        row scales before the wait on the stage, under the TMA's latency."""
        (do_desc, vnew_desc, dvnew_desc, h_desc, dh_desc, q_desc, k_desc, do_s, vnew_s, dvnew_s, h_s, dh_s, q_s, k_s,
         full) = tiles
        (g_ptr, norms_ptr, chunk_start_ptr, chunk_end_ptr, dq_ptr, dk_ptr, dw_ptr, dgc_ptr, dgl_ptr, dpdiag_ptr,
         dpfull_ptr, gcs_ptr, scale, num_items, H, zero) = rest
        C: gl.constexpr = do_s.shape[1]
        KH: gl.constexpr = q_s.shape[2]
        K: gl.constexpr = 2 * KH
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, KH, 16])
        DP: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C // 2, 16])
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        bar, stride, first, start, count = _first_loads(tiles, chunk_start_ptr, chunk_end_ptr, num_items, H, FIRST,
                                                             STEP)
        phase = 0
        for item in range(first, num_items, stride):
            # a stage index the compiler cannot fold (`zero` is 0): see _consumer
            s = FIRST + item * zero
            chunk, head, half, more, next_start, next_count = _item_rows(item, stride, num_items, chunk_start_ptr,
                                                                         chunk_end_ptr, H)
            col0 = half * KH
            rows = gl.arange(0, C, layout=ROW)
            q_scale, k_scale = _row_scales(norms_ptr, (start + rows).to(gl.int64) * H + head, rows < count, scale, C,
                                           L2NORM, ROW)
            gc, gc_last = _channel_decay(g_ptr, gcs_ptr, start, count, head, col0, H, K, C, KH, MMA)
            mbarrier.wait(bar, phase)
            phase ^= 1
            dqg, dkbar, dp, dlam = _channel_products(do_s.index(s), vnew_s.index(s), h_s.index(s), dh_s.index(s), half,
                                                     MMA, DP)
            _released()
            if more:
                _load_products(tiles, s, bar, item + stride, next_start, H)
            _store_dp(dpdiag_ptr, dpfull_ptr, dp, start, count, head, half * (C // 2), H, S, DP)
            dq, dk, dw, dgl = _channel_tail(dqg, dkbar, dlam, gc, gc_last, k_s.index(s), dvnew_s.index(s),
                                            h_s.index(s), k_scale, count, MMA)
            _released()
            if more:
                _load_dw(tiles, s, bar, item + stride, next_start, H)
            # dw out first: its registers are free before q and k come in for dgc
            _store_rows_converted(dw_ptr, -dw, start, count, head, col0, H, K)
            dgc = _scaled(q_s.index(s), q_scale, MMA) * dq - _scaled(k_s.index(s), k_scale, MMA) * dk
            _released()
            if more:
                _load_keys(tiles, s, bar, item + stride, next_start, H)
            _store_rows_converted(dq_ptr, dq, start, count, head, col0, H, K)
            _store_rows_converted(dk_ptr, dk, start, count, head, col0, H, K)
            _store_rows(dgc_ptr, dgc, start, count, head, col0, H, K, MMA)
            cols = gl.arange(0, KH, layout=gl.SliceLayout(0, MMA))
            gl.store(dgl_ptr + (chunk.to(gl.int64) * H + head) * K + col0 + cols, dgl)
            start, count = next_start, next_count

    @gluon.jit
    def channel_state_grad_kernel(do_desc, vnew_desc, dvnew_desc, h_desc, dh_desc, q_desc, k_desc, g_ptr, norms_ptr,
                                  chunk_start_ptr, chunk_end_ptr, dq_ptr, dk_ptr, dw_ptr, dgc_ptr, dgl_ptr,
                                  dpdiag_ptr, dpfull_ptr, gcs_ptr, scale, num_items, H, zero, L2NORM: gl.constexpr,
                                  S: gl.constexpr, WORKER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """backward.state_grad_kernel's outputs for the per-channel decay (KDA) over the same items and stages as
        state_grad_kernel: dq, dk, dw (bf16 [T, H, K]), dgc and gc (fp32 [T, H, K] into dgc and gcs), dgc_last
        (fp32 [NC, H, K]), dP on the causal pattern (fp32 rows [T, H, C] into dpfull, its S x S diagonal blocks rows
        [T, H, S] into dpdiag); g is the log decay [T, H, K], the descriptors as state_grad_kernel's."""
        descs = (do_desc, vnew_desc, dvnew_desc, h_desc, dh_desc, q_desc, k_desc)
        tiles = descs + _allocate_stages(descs, 2) + (_full_barriers(2),)
        rest = (g_ptr, norms_ptr, chunk_start_ptr, chunk_end_ptr, dq_ptr, dk_ptr, dw_ptr, dgc_ptr, dgl_ptr, dpdiag_ptr,
                dpfull_ptr, gcs_ptr, scale, num_items, H, zero)
        gl.warp_specialize([(_channel_consumer, (tiles, rest, L2NORM, S, 0, 2)),
                            (_channel_consumer, (tiles, rest, L2NORM, S, 1, 2))], [4], [WORKER_REGS])


def _rows_desc(x_THD: torch.Tensor, cols: int) -> "TensorDescriptor":
    """[C, cols] blocks of a packed [T, H, D] tensor viewed as [T, H D]."""
    T, H, D = x_THD.shape
    layout = gl.NVMMASharedLayout.get_default_for([CHUNK, cols], gl.bfloat16)
    return TensorDescriptor(x_THD, [T, H * D], [H * D, 1], [CHUNK, cols], layout)


def _state_desc(s_NHKV: torch.Tensor) -> "TensorDescriptor":
    """[KH, V] blocks (a key half of one state) of [NC, H, K, V] states viewed as [NC H K, V]."""
    V = s_NHKV.shape[-1]
    layout = gl.NVMMASharedLayout.get_default_for([KEYS_PER_ITEM, V], gl.bfloat16)
    return TensorDescriptor(s_NHKV, [s_NHKV.numel() // V, V], [V, 1], [KEYS_PER_ITEM, V], layout)


def state_grad(q, k, g, h, dh, v_new, dv_new, do, chunk_start, chunk_end, norms, dq, dk, dw, dgc, dgl, dpdiag, dpfull,
               gcs, scale, l2norm: bool, per_channel: bool) -> bool:
    """backward.state_grad_kernel's outputs (use_state_grad must hold): q, k [T, H, K], v_new, dv_new, do [T, H, V],
    h, dh [NC, H, K, V], all bf16; norms [T, H, 2] fp32 or None (no l2norm); writes dq, dk, dw [T, H, K] bf16, and
    GDN (g [T, H]): dgc [T, H, NK + 1] and dgl [NC, H, NK] fp32 (NK = K / 32); KDA (per_channel, g [T, H, K]): dgc,
    gcs [T, H, K], dgl [NC, H, K], dpfull [T, H, C], dpdiag [T, H, S] fp32 (GDN's are None). Returns False where
    the kernel does not compile here (nothing written). Launched through kernel[grid], not launch.fast: host
    descriptors are not keys fast() can hash."""
    num_chunks, H, K, V = h.shape
    num_items = num_chunks * H * (K // KEYS_PER_ITEM)
    programs_per_sm = 1 if per_channel else PROGRAMS_PER_SM
    grid = (min(num_items, programs_per_sm * num_sms(q.device.index or 0)),)
    descs = [_rows_desc(t, V) for t in (do, v_new, dv_new)] + [_state_desc(t) for t in (h, dh)]
    descs += [_rows_desc(t, KEYS_PER_ITEM) for t in (q, k)]
    if per_channel:
        return compiles("KDA state_grad", lambda: channel_state_grad_kernel[grid](
            *descs, g, norms, chunk_start, chunk_end, dq, dk, dw, dgc, dgl, dpdiag, dpfull, gcs, scale, num_items, H,
            0, L2NORM=l2norm, S=dpdiag.shape[-1], WORKER_REGS=WORKER_REGS, num_warps=4))
    return compiles("GDN state_grad", lambda: state_grad_kernel[grid](
        *descs, g, norms, chunk_start, chunk_end, dq, dk, dw, dgc, dgl, scale, num_items, H, 0, L2NORM=l2norm,
        NK=dgl.shape[-1], num_warps=4))
