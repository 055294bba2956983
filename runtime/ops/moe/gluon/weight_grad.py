"""The experts' weight gradients in Gluon for Hopper (sm_90): out[e] = A[rows_e]^T B[rows_e] ([E, M, N] in B's
dtype) over expert e's sorted rows rows_e, or its transpose B[rows_e]^T A[rows_e] ([E, N, M]), A's rows read by
token (the schedule's token_S) when gather_a, else by sorted row; B's by sorted row. experts._weight_grads runs
it for the gate/up weight gradient (transposed: d_gate_up^T x with x's rows by token, so that the forward writes no
copy of x in expert order) and the down one (dy read by token, by the routing-weight-scaled h) where `fits` says it
applies, in place of torch._grouped_mm.

Why: per expert the reduction is short (~320 rows at 16384 tokens, ~80 at 4096), so a 128 x 256 output tile is 5
(or 2) MMA steps followed by a 64 KB store; the grouped GEMM's cooperative CUTLASS kernel holds its warpgroups in
that epilogue, and the down gradient needed a copy of dy's rows in expert order, scaled.
Here persistent programs walk (expert, output tile) items, three partitions each:
- a producer partition of 4 warps loads each step's A [BK, BM] rows by cp.async, rows past the expert's end
  zero-filled (the reduction's ragged end: they belong to the next expert) and gathered by token where asked (each
  row's token read from the schedule's int64 token_S: dividing its pair by k in the loop, or int32 tokens, are
  slower), and B's two [BK, BN] blocks by TMA (their rows past the end meet A's zeros);
- two consumer warpgroups share each stage, each accumulating BN of the tile's 2 BN columns (transposed: the MMA's
  operands swapped, BN rows of out by BM), and hand their finished tile to TMA stores from shared memory in two
  row halves, the second running while the next item's MMAs do. Half-tile staging leaves room for a fourth
  stage, faster than three stages with whole-tile staging.

Gluon has no CPU interpreter: tests compile the kernel for sm_90a on any machine and compare it with
torch._grouped_mm where a Hopper GPU is; grouped_wgrad.py stays the path elsewhere.

Shape legend: S sorted rows, T tokens, M and N the gradient's sides, E experts; tiles BM x 2 BN outputs, BK rows.
"""
from __future__ import annotations

import torch

from runtime.ops.common import buffers
from runtime.ops.common.gluon_fallback import compiles, num_sms
from runtime.ops.moe.backend import SELECTOR

# Gluon's names, None without its Hopper modules (experts keeps torch._grouped_mm)
from runtime.ops.moe.gluon.language import (
    async_copy, fence_async_shared, gl, gluon, mbarrier, TensorDescriptor, tma, warpgroup_mma, warpgroup_mma_wait,
    tma_load as _tma_load, tma_store as _tma_store, cp_async_load as _async_load, barrier as _barrier,
)

BM, BN, BK = 128, 128, 64
# four stages of A and B (48 KB each) beside the two warpgroups' 16 KB staging tiles (a tile leaves in two halves)
STAGES = 4
# consumer warpgroup 1's and the producer's registers a thread (consumer 0 takes what they leave of 512)
CONSUMER_REGS, PRODUCER_REGS = 232, 48
PRODUCER_WARPS = 4


if gluon is not None:

    @gluon.jit
    def _item(i, tiles_m, tiles_n):
        """Item i: (expert, row block of M, column block of N); an expert's items are consecutive, so that the
        programs in flight share its rows in L2, and the row block of M runs fastest: neighbouring programs read one
        block of B and, transposed, write neighbouring 256-byte pieces of out's rows (TMA stores of constant tiles along
        out's rows write faster in this order than with the column block of N fastest)."""
        per_e = tiles_m * tiles_n
        return i // per_e, i % tiles_m, (i % per_e) // tiles_m

    @gluon.jit
    def _rows_of(ends_ptr, e):
        return gl.load(ends_ptr + e - 1, mask=e > 0, other=0), gl.load(ends_ptr + e)

    @gluon.jit
    def _producer(a_ptr, stride_am, b_desc, out_desc, a_bufs, b0_bufs, b1_bufs, c0_buf, c1_buf, a_ready, b_ready,
                  empty, token_ptr, ends_ptr, num_items, tiles_m, tiles_n, gather_a):
        """Every item's steps of BK rows: B's two column blocks by TMA, A's rows by cp.async (each thread arrives
        on the stage's a_ready once its copies landed), each stage once both consumers are done with it."""
        NUM_STAGES: gl.constexpr = a_bufs.shape[0]
        TILE_K: gl.constexpr = a_bufs.shape[1]
        TILE_M: gl.constexpr = a_bufs.shape[2]
        TILE_N: gl.constexpr = b0_bufs.shape[2]
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
        offs_k = gl.arange(0, TILE_K, layout=gl.SliceLayout(1, LOAD))
        cols = gl.arange(0, TILE_M, layout=gl.SliceLayout(0, LOAD))
        step = 0
        for i in range(gl.program_id(0), num_items, gl.num_programs(0)):
            e, mt, nt = _item(i, tiles_m, tiles_n)
            start, end = _rows_of(ends_ptr, e)
            a_cols = a_ptr + (mt * TILE_M + cols)[None, :]
            # tokens of the step's rows (when gathering), each step's loaded one step ahead
            tokens = gl.load(token_ptr + start + offs_k, mask=(start + offs_k < end) & gather_a, other=0)
            for r0 in range(start, end, TILE_K):
                s = step % NUM_STAGES
                # a fresh barrier counts as released in its preceding phase: the first round passes
                mbarrier.wait(empty.index(s), ((step // NUM_STAGES) & 1) ^ 1)
                mbarrier.expect(b_ready.index(s), 4 * TILE_K * TILE_N)
                _tma_load(b_desc, [r0, nt * 2 * TILE_N], b_ready.index(s), b0_bufs.index(s))
                _tma_load(b_desc, [r0, nt * 2 * TILE_N + TILE_N], b_ready.index(s), b1_bufs.index(s))
                rows = r0 + offs_k
                a_rows = gl.where(gather_a, tokens, rows).to(gl.int64)
                tokens = gl.load(token_ptr + rows + TILE_K, mask=(rows + TILE_K < end) & gather_a, other=0)
                _async_load(a_bufs.index(s), a_cols + a_rows[:, None] * stride_am, mask=(rows < end)[:, None])
                async_copy.mbarrier_arrive(a_ready.index(s), increment_count=False)
                step += 1

    @gluon.jit
    def _consumer(a_ptr, stride_am, b_desc, out_desc, a_bufs, b0_bufs, b1_bufs, c0_buf, c1_buf, a_ready, b_ready,
                  empty, token_ptr, ends_ptr, num_items, tiles_m, tiles_n, gather_a, TRANSPOSED: gl.constexpr,
                  WG: gl.constexpr):
        """Warpgroup WG's column block of every item: its steps' MMAs, then the tile through its staging buffer to
        TMA stores, half a tile each (an expert without rows stores zeros). TRANSPOSED: the MMA's operands swapped,
        so that the accumulator holds the block's b^T a, out[e]'s rows BN of N by BM of M."""
        NUM_STAGES: gl.constexpr = a_bufs.shape[0]
        TILE_K: gl.constexpr = a_bufs.shape[1]
        TILE_M: gl.constexpr = a_bufs.shape[2]
        TILE_N: gl.constexpr = b0_bufs.shape[2]
        # the accumulator's rows and columns: twice the staging tile's rows and its columns ([BN, BM] when TRANSPOSED)
        HALF: gl.constexpr = c0_buf.shape[0]
        ROWS: gl.constexpr = 2 * HALF
        COLS: gl.constexpr = c0_buf.shape[1]
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, COLS, 16])
        if WG == 0:
            b_bufs = b0_bufs
            c_buf = c0_buf
        else:
            b_bufs = b1_bufs
            c_buf = c1_buf
        step = 0
        # each item's row range loaded one item ahead, so that no item starts on a load
        start_next, end_next = _rows_of(ends_ptr, gl.program_id(0) // (tiles_m * tiles_n))
        for i in range(gl.program_id(0), num_items, gl.num_programs(0)):
            e, mt, nt = _item(i, tiles_m, tiles_n)
            n_steps = gl.cdiv(end_next - start_next, TILE_K)
            start_next, end_next = _rows_of(ends_ptr, gl.minimum(i + gl.num_programs(0), num_items - 1)
                                            // (tiles_m * tiles_n))
            acc = gl.zeros([ROWS, COLS], gl.float32, ACC)
            for kk in range(n_steps):
                s = step % NUM_STAGES
                mbarrier.wait(a_ready.index(s), (step // NUM_STAGES) & 1)
                mbarrier.wait(b_ready.index(s), (step // NUM_STAGES) & 1)
                # cp.async wrote through the generic proxy, the MMA reads through the async one
                fence_async_shared()
                if TRANSPOSED:
                    acc = warpgroup_mma(b_bufs.index(s).permute((1, 0)), a_bufs.index(s), acc, is_async=True)
                else:
                    acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                if kk > 0:
                    # the MMA of the step before is done: its stage goes back
                    _barrier()
                    mbarrier.arrive(empty.index((step - 1) % NUM_STAGES))
                step += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if n_steps > 0:
                _barrier()
                mbarrier.arrive(empty.index((step - 1) % NUM_STAGES))
            if TRANSPOSED:
                out_row = (e * tiles_n + nt) * 2 * TILE_N + WG * TILE_N
                out_col = mt * TILE_M
            else:
                out_row = e * tiles_m * TILE_M + mt * TILE_M
                out_col = nt * 2 * TILE_N + WG * TILE_N
            # the accumulator's top and bottom row halves (each warp's two 16-row slabs: no data moves), so that
            # each TMA box row is a whole tile row, 256 bytes
            top, bottom = gl.split(gl.permute(gl.reshape(acc, [2, HALF, COLS]), (1, 2, 0)))
            # each half through the staging tile once the store before has read it
            tma.store_wait(0)
            _barrier()
            c_buf.store(top.to(c_buf.dtype))
            fence_async_shared()
            _barrier()
            _tma_store(out_desc, [out_row, out_col], c_buf)
            tma.store_wait(0)
            _barrier()
            c_buf.store(bottom.to(c_buf.dtype))
            fence_async_shared()
            _barrier()
            _tma_store(out_desc, [out_row + HALF, out_col], c_buf)
        tma.store_wait(0)

    @gluon.jit
    def _consumer0(a_ptr, stride_am, b_desc, out_desc, a_bufs, b0_bufs, b1_bufs, c0_buf, c1_buf, a_ready, b_ready,
                   empty, token_ptr, ends_ptr, num_items, tiles_m, tiles_n, gather_a):
        _consumer(a_ptr, stride_am, b_desc, out_desc, a_bufs, b0_bufs, b1_bufs, c0_buf, c1_buf, a_ready, b_ready,
                  empty, token_ptr, ends_ptr, num_items, tiles_m, tiles_n, gather_a, False, 0)

    @gluon.jit
    def _consumer1(a_ptr, stride_am, b_desc, out_desc, a_bufs, b0_bufs, b1_bufs, c0_buf, c1_buf, a_ready, b_ready,
                   empty, token_ptr, ends_ptr, num_items, tiles_m, tiles_n, gather_a):
        _consumer(a_ptr, stride_am, b_desc, out_desc, a_bufs, b0_bufs, b1_bufs, c0_buf, c1_buf, a_ready, b_ready,
                  empty, token_ptr, ends_ptr, num_items, tiles_m, tiles_n, gather_a, False, 1)

    @gluon.jit
    def _consumer0_t(a_ptr, stride_am, b_desc, out_desc, a_bufs, b0_bufs, b1_bufs, c0_buf, c1_buf, a_ready, b_ready,
                     empty, token_ptr, ends_ptr, num_items, tiles_m, tiles_n, gather_a):
        _consumer(a_ptr, stride_am, b_desc, out_desc, a_bufs, b0_bufs, b1_bufs, c0_buf, c1_buf, a_ready, b_ready,
                  empty, token_ptr, ends_ptr, num_items, tiles_m, tiles_n, gather_a, True, 0)

    @gluon.jit
    def _consumer1_t(a_ptr, stride_am, b_desc, out_desc, a_bufs, b0_bufs, b1_bufs, c0_buf, c1_buf, a_ready, b_ready,
                     empty, token_ptr, ends_ptr, num_items, tiles_m, tiles_n, gather_a):
        _consumer(a_ptr, stride_am, b_desc, out_desc, a_bufs, b0_bufs, b1_bufs, c0_buf, c1_buf, a_ready, b_ready,
                  empty, token_ptr, ends_ptr, num_items, tiles_m, tiles_n, gather_a, True, 1)

    @gluon.jit
    def wgrad_kernel(a_ptr, stride_am, b_desc, out_desc, token_ptr, ends_ptr, num_items, tiles_m, tiles_n, gather_a,
                     TRANSPOSED: gl.constexpr, NUM_STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """Items i = program + j * programs. b_desc: B [S, N] in [BK, BN] blocks; out_desc: out's 2-D view
        [E * M, N] in [BM, BN] blocks, or [E * N, M] in [BN, BM] blocks when TRANSPOSED; A's rows by pointer
        (stride_am), sorted row s's at token_ptr[s] (int64) when gather_a."""
        TILE_K: gl.constexpr = b_desc.block_shape[0]
        # out's block is [BM, BN / 2], or [BN, BM / 2] when TRANSPOSED
        TILE_M: gl.constexpr = 2 * out_desc.block_shape[0] * out_desc.block_shape[1] // b_desc.block_shape[1]
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_K, TILE_M], gl.bfloat16)
        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, TILE_K, TILE_M], a_layout)
        b0_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES] + b_desc.block_shape, b_desc.layout)
        b1_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES] + b_desc.block_shape, b_desc.layout)
        c0_buf = gl.allocate_shared_memory(gl.bfloat16, out_desc.block_shape, out_desc.layout)
        c1_buf = gl.allocate_shared_memory(gl.bfloat16, out_desc.block_shape, out_desc.layout)
        a_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        b_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            # one arrival per producer thread, its cp.async copies landed
            mbarrier.init(a_ready.index(i), count=32 * PRODUCER_WARPS)
            mbarrier.init(b_ready.index(i), count=1)
            # released by both consumers
            mbarrier.init(empty.index(i), count=2)
        fence_async_shared()
        _barrier()
        args = (a_ptr, stride_am, b_desc, out_desc, a_bufs, b0_bufs, b1_bufs, c0_buf, c1_buf, a_ready, b_ready, empty,
                token_ptr, ends_ptr, num_items, tiles_m, tiles_n, gather_a)
        # a constexpr in the arguments' tuple arrives as a tensor: each orientation has its consumers
        if TRANSPOSED:
            gl.warp_specialize([(_consumer0_t, args), (_consumer1_t, args), (_producer, args)], [4, PRODUCER_WARPS],
                               [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_producer, args)], [4, PRODUCER_WARPS],
                               [CONSUMER_REGS, PRODUCER_REGS])


def shared_bytes() -> int:
    """The stages of A and B, the two staging tiles and the barriers."""
    return 2 * (STAGES * (BK * BM + 2 * BK * BN) + BM * BN) + 8 * 3 * STAGES


def out_block(transposed: bool) -> list[int]:
    """The staging tile, out's TMA block: half a warpgroup's [BM, BN] tile ([BN, BM] transposed), split by rows, so
    that each of the box's rows is a whole tile row (256 bytes; faster than column halves of 128 bytes)."""
    return [BN // 2, BM] if transposed else [BM // 2, BN]


def fits_shape(M: int, N: int, dtype: torch.dtype) -> bool:
    """The tile rules: bf16, M whole BM blocks, N whole blocks of 2 BN (a BN half for each consumer)."""
    return dtype == torch.bfloat16 and M % BM == 0 and N % (2 * BN) == 0 and M > 0 and N > 0


def takes(a: torch.Tensor, n: int) -> bool:
    """Whether the Gluon kernel takes a^T b for a b of n columns in a's dtype, contiguous: on a Hopper GPU, a
    contiguous, and the tile rules (either orientation of the output)."""
    if gluon is None or not a.is_cuda or SELECTOR.choose(a.device) != "hopper":
        return False
    return a.is_contiguous() and fits_shape(a.shape[1], n, a.dtype)


def fits(a: torch.Tensor, b_SN: torch.Tensor) -> bool:
    """Whether the Gluon kernel takes a^T b: on a Hopper GPU, a and b contiguous, one dtype, and the tile rules."""
    return a.dtype == b_SN.dtype and b_SN.is_contiguous() and takes(a, b_SN.shape[1])


def wgrad(a, b_SN, sched, gather_a: bool = False, transposed: bool = False) -> torch.Tensor | None:
    """[E, M, N]: per expert a[rows]^T b[rows] over its sorted rows, a's rows by token (a is [T, M]) when gather_a,
    else by sorted row (a is [S, M]); [E, N, M], its transpose b[rows]^T a[rows], when `transposed` (so that the
    gate/up weight gradient can gather x's rows by token as a). `fits` must hold. None where the kernel does not
    compile here."""
    M, N, E = a.shape[1], b_SN.shape[1], sched.num_experts
    b_layout = gl.NVMMASharedLayout.get_default_for([BK, BN], gl.bfloat16)
    b_desc = TensorDescriptor(b_SN, list(b_SN.shape), [N, 1], [BK, BN], b_layout)
    rows, cols = (N, M) if transposed else (M, N)
    out = buffers.empty(E, rows, cols, dtype=b_SN.dtype, device=b_SN.device)
    block = out_block(transposed)
    c_layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    out_desc = TensorDescriptor(out.view(E * rows, cols), [E * rows, cols], [cols, 1], block, c_layout)
    tiles_m, tiles_n = M // BM, N // (2 * BN)
    num_items = E * tiles_m * tiles_n
    grid = (min(num_items, num_sms(b_SN.device.index or 0)),)
    # int64 token rows either way (pair_S unread when not gathering): one compiled kernel for both
    ran = compiles("MoE weight gradient", lambda: wgrad_kernel[grid](
        a, a.stride(0), b_desc, out_desc, sched.token_S if gather_a else sched.pair_S, sched.ends_E, num_items,
        tiles_m, tiles_n, gather_a, TRANSPOSED=transposed, NUM_STAGES=STAGES, PRODUCER_WARPS=PRODUCER_WARPS,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4))
    return out if ran else None
