"""The experts' down projection in Gluon for Hopper (sm_90): y[pair(s)] = (h[s] @ W_down[e(s)]^T) * w[pair(s)] over the
expert-sorted rows s, the routing weight applied and the rows scattered to pair order (grouped_gemm's plain mode with
those options), for F <= 512; experts._down runs it in place of the Triton kernel where `fits` says it applies.

Why: at K = F = 512 (Qwen3-Next) a Triton program does 8 steps of its 128 x 256 tile and then its scattered 64 KB
store, one program an SM, so the first loads' latency and the epilogue (the routing weight's load at the pairs,
then the stores) are hidden behind no MMA, where dh, the same FLOPs at K = 2048, is not held so. Here persistent
programs walk the schedule's row tiles, three partitions each:
- a producer warp TMA-loads the row tile's h whole (K / BK chunks, each refilled for the next row tile once both
  consumers' last readers of it are done) and W's [BN, BK] tiles of every column block into a ring of STAGES;
- two consumer warpgroups take the row tile's column blocks in turn (ping-pong, as CUTLASS calls it): each issues
  its block's MMAs once the other has issued its last of the block before, so that the MMAs run in block order and
  the ring is read in order, and stores its 128 x 128 tile while the other computes the next one. The rows' routing
  weights and output rows are loaded once a row tile, before its first block, and the tile is stored in 16-byte
  vectors along its rows.
Outputs are bit-identical to the Triton kernel's. h streamed through the ring instead of loaded whole is no faster at
K = 512 and no faster than Triton for dx at K = 1024, which stays on the Triton kernel.

Rows past an expert's end in its last tile: TMA reads them (the next expert's rows, zeros past S), their results are
not stored. Gluon has no CPU interpreter: tests compile the kernel for sm_90a on any machine and compare it with the
Triton kernel where a Hopper GPU is; the Triton kernel stays the path everywhere else.

Shape legend: S sorted rows, N = D output columns, K = F reduction width, E experts; tiles BM rows x BN x BK.
"""
from __future__ import annotations

import torch

from runtime.ops.common.gluon_fallback import compiles, num_sms
from runtime.ops.moe.backend import SELECTOR

# Gluon's names, None without its Hopper modules (experts._down keeps the Triton kernel)
from runtime.ops.moe.gluon.language import SHARED_BYTES
from runtime.ops.moe.gluon.language import (
    fence_async_shared, gl, gluon, mbarrier, TensorDescriptor, warpgroup_mma, warpgroup_mma_wait,
    tma_load as _tma_load, barrier as _barrier,
)

BM, BN, BK = 128, 128, 64
# the W ring: the more stages the faster, and 5 with h whole and the epilogue's conversion take 229,600 of the
# 232,448 bytes of shared memory a block can hold
STAGES = 5
# consumer warpgroup 1's and the producer warp's registers a thread (consumer 0 takes what they leave)
CONSUMER_REGS, PRODUCER_REGS = 232, 40


if gluon is not None:

    @gluon.jit
    def _producer(a_desc, w_desc, a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, turn, y_ptr, stride_ym,
                  scale_ptr, pair_ptr, tile_expert_ptr, tile_start_ptr, ends_ptr, num_experts, num_tiles, N, K):
        """TMA of this program's row tiles: each A chunk (BK columns) once its last readers in the row tile before
        are done, and W's tiles of every column block into the ring, each stage once its reader is done."""
        A_CHUNKS: gl.constexpr = a_bufs.shape[0]
        NUM_STAGES: gl.constexpr = w_bufs.shape[0]
        TILE_N: gl.constexpr = w_bufs.shape[1]
        TILE_K: gl.constexpr = w_bufs.shape[2]
        r = 0  # the program's row tiles so far
        step = 0  # its W tiles so far
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            e = gl.load(tile_expert_ptr + t)
            if e < num_experts:
                r0 = gl.load(tile_start_ptr + t)
                for n0 in range(0, N, TILE_N):
                    for kk in range(A_CHUNKS):
                        if n0 == 0:
                            # a fresh barrier counts as released in its preceding phase: the first round passes
                            mbarrier.wait(a_empty.index(kk), (r & 1) ^ 1)
                            mbarrier.expect(a_ready.index(kk), 2 * TILE_K * a_bufs.shape[1])
                            _tma_load(a_desc, [r0, kk * TILE_K], a_ready.index(kk), a_bufs.index(kk))
                        s = step % NUM_STAGES
                        mbarrier.wait(w_empty.index(s), ((step // NUM_STAGES) & 1) ^ 1)
                        mbarrier.expect(w_ready.index(s), 2 * TILE_K * TILE_N)
                        _tma_load(w_desc, [e * N + n0, kk * TILE_K], w_ready.index(s), w_bufs.index(s))
                        step += 1
                r += 1

    @gluon.jit
    def _row_targets(y_ptr, stride_ym, scale_ptr, pair_ptr, r0, end, ACC: gl.constexpr, STORE: gl.constexpr,
                     TILE_M: gl.constexpr):
        """A row tile's (routing weight [BM] in ACC's row slice; y's row pointers, the rows' pairs, and the rows
        below `end`, [BM] in STORE's row slice): loaded at the row tile's start, so that no block's store waits on
        them."""
        rows = r0 + gl.arange(0, TILE_M, layout=gl.SliceLayout(1, ACC))
        pairs = gl.load(pair_ptr + rows, mask=rows < end, other=0)
        scale = gl.load(scale_ptr + pairs, mask=rows < end, other=0.0).to(gl.float32)
        rows = r0 + gl.arange(0, TILE_M, layout=gl.SliceLayout(1, STORE))
        row_ok = rows < end
        pairs = gl.load(pair_ptr + rows, mask=row_ok, other=0).to(gl.int64)
        return scale, y_ptr + pairs * stride_ym, row_ok

    @gluon.jit
    def _store_tile(acc, scale, row_ptrs, row_ok, n0, STORE: gl.constexpr):
        """acc [BM, BN] (columns n0..) times the routing weight (fp32, then rounded once) into y's rows, stored
        from a layout of 16-byte vectors along the row."""
        out = gl.convert_layout((acc * scale[:, None]).to(row_ptrs.dtype.element_ty), STORE)
        cols = n0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, STORE))
        gl.store(row_ptrs[:, None] + cols[None, :], out, mask=row_ok[:, None])

    @gluon.jit
    def _consumer(a_desc, w_desc, a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, turn, y_ptr, stride_ym,
                  scale_ptr, pair_ptr, tile_expert_ptr, tile_start_ptr, ends_ptr, num_experts, num_tiles, N, K,
                  WG: gl.constexpr):
        """Warpgroup WG's blocks: the column blocks n of the program's row tiles with n % 2 == WG, each once the
        other warpgroup has issued its last MMA of the block before; each warpgroup's last column block of a row
        tile releases its A chunks."""
        A_CHUNKS: gl.constexpr = a_bufs.shape[0]
        NUM_STAGES: gl.constexpr = w_bufs.shape[0]
        TILE_M: gl.constexpr = a_bufs.shape[1]
        TILE_N: gl.constexpr = w_bufs.shape[1]
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, TILE_N, 16])
        # 16-byte vectors, 8 threads a row's 64 columns: full 32-byte sectors, 8 rows a thread over the tile (16 rows a
        # thread, a row's 128 columns in 16 threads, need more registers than the consumer has)
        STORE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        num_n = N // TILE_N
        r = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            e = gl.load(tile_expert_ptr + t)
            if e < num_experts:
                scale, row_ptrs, row_ok = _row_targets(y_ptr, stride_ym, scale_ptr, pair_ptr,
                                                       gl.load(tile_start_ptr + t), gl.load(ends_ptr + e), ACC,
                                                       STORE, TILE_M)
                for n in range(WG, num_n, 2):
                    j = r * num_n + n  # the program's block index (num_n is even: blocks alternate warpgroups)
                    # warpgroup 0's first turn is free (a fresh barrier's preceding phase)
                    mbarrier.wait(turn.index(WG), ((j // 2) & 1) ^ (1 - WG))
                    last = n >= num_n - 2  # this warpgroup's last column block of the row tile
                    acc = gl.zeros([TILE_M, TILE_N], gl.float32, ACC)
                    for kk in range(A_CHUNKS):
                        step = j * A_CHUNKS + kk
                        s = step % NUM_STAGES
                        mbarrier.wait(a_ready.index(kk), r & 1)
                        mbarrier.wait(w_ready.index(s), (step // NUM_STAGES) & 1)
                        acc = warpgroup_mma(a_bufs.index(kk), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
                        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                        if kk > 0:
                            # the MMA of the step before is done: its W stage (and in the warpgroup's last column
                            # block its A chunk) goes back to the producer
                            _barrier()
                            mbarrier.arrive(w_empty.index((step - 1) % NUM_STAGES))
                            if last:
                                mbarrier.arrive(a_empty.index(kk - 1))
                    _barrier()
                    mbarrier.arrive(turn.index(1 - WG))
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                    _barrier()
                    mbarrier.arrive(w_empty.index((j * A_CHUNKS + A_CHUNKS - 1) % NUM_STAGES))
                    if last:
                        mbarrier.arrive(a_empty.index(A_CHUNKS - 1))
                    _store_tile(acc, scale, row_ptrs, row_ok, n * TILE_N, STORE)
                r += 1

    @gluon.jit
    def _consumer0(a_desc, w_desc, a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, turn, y_ptr, stride_ym,
                   scale_ptr, pair_ptr, tile_expert_ptr, tile_start_ptr, ends_ptr, num_experts, num_tiles, N, K):
        _consumer(a_desc, w_desc, a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, turn, y_ptr, stride_ym,
                  scale_ptr, pair_ptr, tile_expert_ptr, tile_start_ptr, ends_ptr, num_experts, num_tiles, N, K, 0)

    @gluon.jit
    def _consumer1(a_desc, w_desc, a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, turn, y_ptr, stride_ym,
                   scale_ptr, pair_ptr, tile_expert_ptr, tile_start_ptr, ends_ptr, num_experts, num_tiles, N, K):
        _consumer(a_desc, w_desc, a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, turn, y_ptr, stride_ym,
                  scale_ptr, pair_ptr, tile_expert_ptr, tile_start_ptr, ends_ptr, num_experts, num_tiles, N, K, 1)

    @gluon.jit
    def down_gemm_kernel(a_desc, w_desc, y_ptr, stride_ym, scale_ptr, pair_ptr, tile_expert_ptr, tile_start_ptr,
                         ends_ptr, num_experts, num_tiles, N, K: gl.constexpr, NUM_STAGES: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """Row tiles t = program + i * programs of the schedule (skipped where its expert is E), each with all of
        A's K columns in shared memory while its N / BN column blocks run. a_desc: A [S, K] in [BM, BK] blocks;
        w_desc: W's 2-D view [E * N, K] in [BN, BK] blocks."""
        A_CHUNKS: gl.constexpr = K // a_desc.block_shape[1]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [A_CHUNKS] + a_desc.block_shape, a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES] + w_desc.block_shape, w_desc.layout)
        a_ready = gl.allocate_shared_memory(gl.int64, [A_CHUNKS, 1], mbarrier.MBarrierLayout())
        a_empty = gl.allocate_shared_memory(gl.int64, [A_CHUNKS, 1], mbarrier.MBarrierLayout())
        w_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        w_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(A_CHUNKS):
            mbarrier.init(a_ready.index(i), count=1)
            # released by each warpgroup's last column block of the row tile
            mbarrier.init(a_empty.index(i), count=2)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(w_ready.index(i), count=1)
            mbarrier.init(w_empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        fence_async_shared()
        _barrier()
        args = (a_desc, w_desc, a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, turn, y_ptr, stride_ym,
                scale_ptr, pair_ptr, tile_expert_ptr, tile_start_ptr, ends_ptr, num_experts, num_tiles, N, K)
        gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_producer, args)], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])


def shared_bytes(K: int) -> int:
    """A's row tile whole, the W ring, the epilogue's layout conversion (BM * BN bytes: its scratch as compiled) and
    the barriers."""
    return 2 * (BM * K + STAGES * BN * BK) + BM * BN + 8 * (2 * K // BK + 2 * STAGES + 2)


def fits_shape(K: int, N: int, dtype: torch.dtype, block_m: int) -> bool:
    """The tile rules: bf16, the schedule's row tiles BM rows, N an even number of column blocks (blocks alternate
    warpgroups within a row tile), K whole chunks that fit in shared memory beside the W ring (K <= 512)."""
    return (dtype == torch.bfloat16 and block_m == BM and N % (2 * BN) == 0 and K % BK == 0
            and shared_bytes(K) <= SHARED_BYTES)


def fits(h_SK: torch.Tensor, w_ENK: torch.Tensor, y: torch.Tensor, block_m: int) -> bool:
    """Whether the Gluon kernel takes this down projection: on a Hopper GPU, h, W and y contiguous, one dtype, and
    the tile rules."""
    if gluon is None or not h_SK.is_cuda or SELECTOR.choose(h_SK.device) != "hopper":
        return False
    return (h_SK.dtype == w_ENK.dtype == y.dtype and h_SK.is_contiguous() and w_ENK.is_contiguous()
            and y.is_contiguous() and y.shape[1] == w_ENK.shape[1]
            and fits_shape(h_SK.shape[1], w_ENK.shape[1], h_SK.dtype, block_m))


def down_gemm(h_SK, w_ENK, sched, y, weight_P) -> bool:
    """y[pair(s)] = (h[s] @ W[e(s)]^T) * weight[pair(s)] for every sorted row s (`fits` must hold): writes y and
    returns True, or returns False where the kernel does not compile here (nothing written)."""
    E, N, K = w_ENK.shape
    a_layout = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    a_desc = TensorDescriptor(h_SK, list(h_SK.shape), [K, 1], [BM, BK], a_layout)
    w_layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    w_desc = TensorDescriptor(w_ENK.view(E * N, K), [E * N, K], [K, 1], [BN, BK], w_layout)
    grid = (min(sched.num_tiles, num_sms(h_SK.device.index or 0)),)
    return compiles("MoE down GEMM", lambda: down_gemm_kernel[grid](
        a_desc, w_desc, y, y.stride(0), weight_P, sched.pair_S, sched.tile_expert, sched.tile_start, sched.ends_E,
        sched.num_experts, sched.num_tiles, N, K, NUM_STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, num_warps=4))
