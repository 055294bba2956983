"""The experts' gate/up projection with the GLU in Gluon for Hopper (sm_90): for each expert-sorted row s,
gate_up[s] = x[pair(s) // k] @ W_gu[e(s)]^T (the pre-activation, kept for the backward) and h[s] = silu(gate) * up,
x's rows gathered by token; optionally also the copy x_sorted[s] = x[pair(s) // k] that the gate/up weight gradient
reduces over. grouped_gemm's GLU_FWD mode without bias, LoRA, clamp or interleaving; experts._gate_up runs it in
its place (and in place of gather_tokens' copy) where `fits` says it applies.

Why: the Triton kernel runs one 128 x 256 tile a program, one program an SM, so the first loads' latency and its
epilogue (96 KB of gate/up and h stores) are hidden behind no MMA; and in full fine-tuning a separate pass copies
x's rows in expert order for the weight gradient, reading and writing 671 MB at 16384 tokens. Here persistent
programs walk work items, each a row tile of the schedule and a block of 2 BU units, three partitions each:
- a producer partition of 4 warps gathers A's [BM, BK] tiles of x's rows with cp.async (TMA has no row gather on
  Hopper) and TMA-loads W's gate and up [BU, BK] tiles of 2 BU units into one [4 BU, BK] stage of a ring, running
  ahead into the next item while the consumers store;
- two consumer warpgroups share each stage: warpgroup w takes units u0 + w BU.. of the block, its accumulator
  [BM, 2 BU] holding their gate in its left half and their up in its right, so that one MMA a step covers both and
  a thread holds each unit's gate and up side by side for the GLU.
- Where the copy is asked for, warpgroup 0 TMA-stores each A tile of a row tile's first block to x_sorted: the
  gathered rows leave shared memory once, with no second read of x.
Outputs are bit-identical to the Triton kernel's. Not ping-pong (a [BM, 2 BU] tile a warpgroup): that streams a
third more bytes per product. Items of one block rather than whole row tiles (a tile's blocks in turn on one
program): faster, and the blocks of a tile no longer each fetch its x rows from HBM again.

Rows past an expert's end in its last tile: their gate/up and h are not stored. Without the copy their A rows are
zero-filled: no gathers from L2 for them, and zeros cost the tensor cores less power, which counts because a step
replayed back to back runs at the GPU's power cap. With the copy A holds their real rows (the next expert's sorted
rows; row 0 of x past S), so the copy stores correct rows there (the tile of their own expert stores the same bytes)
and TMA drops rows past S.
Gluon has no CPU interpreter: tests compile the kernel for sm_90a on any machine and compare it with the Triton kernel
where a Hopper GPU is; the Triton kernel stays the path elsewhere.

Shape legend: T tokens, S sorted rows, K = D model width (the reduction), F units (gate/up are 2F rows of W),
E experts; tiles BM rows x BU units a warpgroup x BK.
"""
from __future__ import annotations

import torch

from runtime.ops.common.gluon_fallback import compiles, num_sms
from runtime.ops.moe.backend import SELECTOR

# Gluon's names, None without its Hopper modules (experts._gate_up keeps the Triton kernel)
from runtime.ops.moe.gluon.language import (
    async_copy, fence_async_shared, gl, gluon, mbarrier, TensorDescriptor, tma, warpgroup_mma, warpgroup_mma_wait,
    tma_load as _tma_load, tma_store as _tma_store, cp_async_load as _async_load, barrier as _barrier,
)

BM, BU, BK = 128, 64, 64
# the ring: 4 stages (192 KB), faster than 3
STAGES = 4
# consumer warpgroup 1's and the producer's registers a thread (consumer 0 takes what they leave of 512)
CONSUMER_REGS, PRODUCER_REGS = 224, 48
PRODUCER_WARPS = 4


if gluon is not None:

    @gluon.jit
    def _producer(x_ptr, stride_xm, w_desc, xs_desc, a_bufs, w_bufs, a_ready, w_ready, empty, gu_ptr,
                  stride_gum, h_ptr, stride_hm, pair_ptr, tile_expert_ptr, tile_start_ptr, ends_ptr, num_experts,
                  num_tiles, S, F, K, top_k, store_x):
        """For every item (row tile, block of 2 BU units): x's gathered rows by cp.async (each thread arrives on the
        stage's a_ready once its copies landed) and W's gate and up tiles of the block's two halves by TMA, each
        stage once both its readers are done."""
        NUM_STAGES: gl.constexpr = a_bufs.shape[0]
        TILE_M: gl.constexpr = a_bufs.shape[1]
        TILE_K: gl.constexpr = a_bufs.shape[2]
        UNITS: gl.constexpr = w_bufs.shape[1] // 4
        k_steps = K // TILE_K
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        cols = gl.arange(0, TILE_K, layout=gl.SliceLayout(0, LOAD))
        step = 0
        num_blocks = F // (2 * UNITS)
        # a tile's blocks are neighbouring items, run by neighbouring programs: they gather its x rows at about the
        # same time, so all but the first find them in L2
        for i in range(gl.program_id(0), num_tiles * num_blocks, gl.num_programs(0)):
            t = i // num_blocks
            u0 = (i % num_blocks) * 2 * UNITS
            e = gl.load(tile_expert_ptr + t)
            if e < num_experts:
                rows = gl.load(tile_start_ptr + t) + gl.arange(0, TILE_M, layout=gl.SliceLayout(1, LOAD))
                # rows past S read x's row 0: finite, never stored
                pairs = gl.load(pair_ptr + rows, mask=rows < S, other=0).to(gl.int32)
                a_ptrs = x_ptr + (pairs // top_k).to(gl.int64)[:, None] * stride_xm + cols[None, :]
                # rows past the expert's end zero-filled (their products are never stored) unless the copy stores them
                a_mask = ((rows < gl.load(ends_ptr + e)) | store_x)[:, None]
                for kk in range(k_steps):
                    s = step % NUM_STAGES
                    # a fresh barrier counts as released in its preceding phase: the first round passes
                    mbarrier.wait(empty.index(s), ((step // NUM_STAGES) & 1) ^ 1)
                    mbarrier.expect(w_ready.index(s), 8 * UNITS * TILE_K)
                    w_stage = w_bufs.index(s)
                    # warpgroup 0's gate and up rows, then warpgroup 1's
                    g0 = e * 2 * F + u0
                    _tma_load(w_desc, [g0, kk * TILE_K], w_ready.index(s), w_stage.slice(0, UNITS))
                    _tma_load(w_desc, [g0 + F, kk * TILE_K], w_ready.index(s), w_stage.slice(UNITS, UNITS))
                    _tma_load(w_desc, [g0 + UNITS, kk * TILE_K], w_ready.index(s), w_stage.slice(2 * UNITS, UNITS))
                    _tma_load(w_desc, [g0 + F + UNITS, kk * TILE_K], w_ready.index(s),
                              w_stage.slice(3 * UNITS, UNITS))
                    _async_load(a_bufs.index(s), a_ptrs + kk * TILE_K, mask=a_mask)
                    async_copy.mbarrier_arrive(a_ready.index(s), increment_count=False)
                    step += 1

    @gluon.jit
    def _store_block(acc, rows, row_ok, u0, gu_ptr, stride_gum, h_ptr, stride_hm, F, STORE: gl.constexpr):
        """acc [BM, 2 BU] (gate units u0.. on the left, their up on the right): gate/up rounded into gate_up's
        columns u0.. and F + u0.., h = silu(gate) * up from the fp32 values into h's, 16-byte vectors along rows."""
        UNITS: gl.constexpr = acc.shape[1] // 2
        gate, up = gl.split(gl.permute(gl.reshape(acc, [acc.shape[0], 2, UNITS]), (0, 2, 1)))
        # tl.sigmoid's form (the Triton kernel's h, bit for bit)
        h = gate * (1.0 / (1.0 + gl.exp(-gate))) * up
        cols = u0 + gl.arange(0, UNITS, layout=gl.SliceLayout(0, STORE))
        mask = row_ok[:, None]
        h_ptrs = h_ptr + rows.to(gl.int64)[:, None] * stride_hm + cols[None, :]
        gl.store(h_ptrs, gl.convert_layout(h.to(h_ptr.dtype.element_ty), STORE), mask=mask)
        gu = gl.convert_layout(acc.to(gu_ptr.dtype.element_ty), STORE)
        g16, u16 = gl.split(gl.permute(gl.reshape(gu, [acc.shape[0], 2, UNITS]), (0, 2, 1)))
        gu_ptrs = gu_ptr + rows.to(gl.int64)[:, None] * stride_gum + cols[None, :]
        gl.store(gu_ptrs, gl.convert_layout(g16, STORE), mask=mask)
        gl.store(gu_ptrs + F, gl.convert_layout(u16, STORE), mask=mask)

    @gluon.jit
    def _consumer(x_ptr, stride_xm, w_desc, xs_desc, a_bufs, w_bufs, a_ready, w_ready, empty, gu_ptr,
                  stride_gum, h_ptr, stride_hm, pair_ptr, tile_expert_ptr, tile_start_ptr, ends_ptr, num_experts,
                  num_tiles, S, F, K, top_k, store_x, WG: gl.constexpr):
        """Warpgroup WG's half of the block of units of each of the program's items; with store_x, warpgroup 0 also
        TMA-stores each A tile of a row tile's first block to x_sorted before the stage goes back."""
        NUM_STAGES: gl.constexpr = a_bufs.shape[0]
        TILE_M: gl.constexpr = a_bufs.shape[1]
        TILE_K: gl.constexpr = a_bufs.shape[2]
        TILE_N: gl.constexpr = w_bufs.shape[1] // 2
        k_steps = K // TILE_K
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, TILE_N, 16])
        # 16-byte vectors, 8 threads a row's 64 columns, 8 rows a thread over the tile (as down_gemm.py)
        STORE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        num_n = F // TILE_N
        j = 0
        for i in range(gl.program_id(0), num_tiles * num_n, gl.num_programs(0)):
            t = i // num_n
            n = i % num_n
            e = gl.load(tile_expert_ptr + t)
            if e < num_experts:
                r0 = gl.load(tile_start_ptr + t)
                rows = r0 + gl.arange(0, TILE_M, layout=gl.SliceLayout(1, STORE))
                row_ok = rows < gl.load(ends_ptr + e)
                copy = store_x & (n == 0) & (WG == 0)
                acc = gl.zeros([TILE_M, TILE_N], gl.float32, ACC)
                for kk in range(k_steps):
                    step = j * k_steps + kk
                    s = step % NUM_STAGES
                    mbarrier.wait(a_ready.index(s), (step // NUM_STAGES) & 1)
                    mbarrier.wait(w_ready.index(s), (step // NUM_STAGES) & 1)
                    # cp.async wrote through the generic proxy, the MMA and the TMA store read through the async one
                    fence_async_shared()
                    if copy:
                        _tma_store(xs_desc, [r0, kk * TILE_K], a_bufs.index(s))
                    acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).slice(WG * TILE_N, TILE_N).permute((1, 0)),
                                        acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                    if kk > 0:
                        # the MMA of the step before is done (and its copy out, the one before this one)
                        tma.store_wait(1)
                        _barrier()
                        mbarrier.arrive(empty.index((step - 1) % NUM_STAGES))
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                tma.store_wait(0)
                _barrier()
                mbarrier.arrive(empty.index((j * k_steps + k_steps - 1) % NUM_STAGES))
                _store_block(acc, rows, row_ok, n * TILE_N + WG * (TILE_N // 2), gu_ptr, stride_gum, h_ptr,
                             stride_hm, F, STORE)
                j += 1

    @gluon.jit
    def _consumer0(x_ptr, stride_xm, w_desc, xs_desc, a_bufs, w_bufs, a_ready, w_ready, empty, gu_ptr,
                   stride_gum, h_ptr, stride_hm, pair_ptr, tile_expert_ptr, tile_start_ptr, ends_ptr, num_experts,
                   num_tiles, S, F, K, top_k, store_x):
        _consumer(x_ptr, stride_xm, w_desc, xs_desc, a_bufs, w_bufs, a_ready, w_ready, empty, gu_ptr,
                  stride_gum, h_ptr, stride_hm, pair_ptr, tile_expert_ptr, tile_start_ptr, ends_ptr, num_experts,
                  num_tiles, S, F, K, top_k, store_x, 0)

    @gluon.jit
    def _consumer1(x_ptr, stride_xm, w_desc, xs_desc, a_bufs, w_bufs, a_ready, w_ready, empty, gu_ptr,
                   stride_gum, h_ptr, stride_hm, pair_ptr, tile_expert_ptr, tile_start_ptr, ends_ptr, num_experts,
                   num_tiles, S, F, K, top_k, store_x):
        _consumer(x_ptr, stride_xm, w_desc, xs_desc, a_bufs, w_bufs, a_ready, w_ready, empty, gu_ptr,
                  stride_gum, h_ptr, stride_hm, pair_ptr, tile_expert_ptr, tile_start_ptr, ends_ptr, num_experts,
                  num_tiles, S, F, K, top_k, store_x, 1)

    @gluon.jit
    def glu_gemm_kernel(x_ptr, stride_xm, w_desc, xs_desc, gu_ptr, stride_gum, h_ptr, stride_hm, pair_ptr,
                        tile_expert_ptr, tile_start_ptr, ends_ptr, num_experts, num_tiles, S, F, K, top_k, store_x,
                        NUM_STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                        PRODUCER_REGS: gl.constexpr):
        """Items i = program + j * programs: row tile i // (F / (2 BU)) of the schedule (skipped where its expert is
        E) and its block of units i % (F / (2 BU)). w_desc: W_gu's 2-D view [E * 2F, K] in [BU, BK] blocks; xs_desc:
        x_sorted [S, K] in [BM, BK] blocks (not written unless store_x)."""
        a_layout: gl.constexpr = xs_desc.layout
        TILE_M: gl.constexpr = xs_desc.block_shape[0]
        TILE_K: gl.constexpr = xs_desc.block_shape[1]
        UNITS: gl.constexpr = w_desc.block_shape[0]
        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, TILE_M, TILE_K], a_layout)
        w_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 4 * UNITS, TILE_K], w_desc.layout)
        a_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        w_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            # one arrival per producer thread, its cp.async copies landed
            mbarrier.init(a_ready.index(i), count=32 * PRODUCER_WARPS)
            mbarrier.init(w_ready.index(i), count=1)
            # released by both consumers
            mbarrier.init(empty.index(i), count=2)
        fence_async_shared()
        _barrier()
        args = (x_ptr, stride_xm, w_desc, xs_desc, a_bufs, w_bufs, a_ready, w_ready, empty, gu_ptr, stride_gum,
                h_ptr, stride_hm, pair_ptr, tile_expert_ptr, tile_start_ptr, ends_ptr, num_experts, num_tiles, S, F,
                K, top_k, store_x)
        gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_producer, args)], [4, PRODUCER_WARPS],
                           [CONSUMER_REGS, PRODUCER_REGS])


def shared_bytes() -> int:
    """The ring (A and W stages) and the barriers; the epilogue's layout conversions' scratch comes on top."""
    return 2 * STAGES * (BM * BK + 4 * BU * BK) + 8 * 3 * STAGES


def fits_shape(K: int, F: int, dtype: torch.dtype, block_m: int) -> bool:
    """The tile rules: bf16, the schedule's row tiles BM rows, F whole blocks of 2 BU units (a BU-unit half for each
    consumer warpgroup), K whole BK chunks."""
    return dtype == torch.bfloat16 and block_m == BM and F % (2 * BU) == 0 and K % BK == 0 and K > 0


def fits(x_TK: torch.Tensor, w_E2FK: torch.Tensor, block_m: int) -> bool:
    """Whether the Gluon kernel takes this gate/up projection: on a Hopper GPU, x and W contiguous, one dtype, and
    the tile rules."""
    if gluon is None or not x_TK.is_cuda or SELECTOR.choose(x_TK.device) != "hopper":
        return False
    return (x_TK.dtype == w_E2FK.dtype and x_TK.is_contiguous() and w_E2FK.is_contiguous()
            and x_TK.shape[1] == w_E2FK.shape[2]
            and fits_shape(x_TK.shape[1], w_E2FK.shape[1] // 2, x_TK.dtype, block_m))


def glu_gemm(x_TK, w_E2FK, sched, gate_up_S2F, h_SF, x_sorted_SK=None) -> bool:
    """gate_up[s] = x[pair(s) // k] @ W[e(s)]^T and h[s] = silu(gate) * up for every sorted row s (`fits` must
    hold), and x_sorted[s] = x[pair(s) // k] when given: writes them and returns True, or returns False where the
    kernel does not compile here (nothing written)."""
    E, two_f, K = w_E2FK.shape
    S = sched.pair_S.numel()
    a_layout = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    # without the copy x stands in for its descriptor, never written
    x_sorted = x_sorted_SK if x_sorted_SK is not None else x_TK
    xs_desc = TensorDescriptor(x_sorted, list(x_sorted.shape), [K, 1], [BM, BK], a_layout)
    w_layout = gl.NVMMASharedLayout.get_default_for([BU, BK], gl.bfloat16)
    w_desc = TensorDescriptor(w_E2FK.view(E * two_f, K), [E * two_f, K], [K, 1], [BU, BK], w_layout)
    grid = (min(sched.num_tiles * (two_f // (4 * BU)), num_sms(x_TK.device.index or 0)),)
    return compiles("MoE gate/up GEMM", lambda: glu_gemm_kernel[grid](
        x_TK, x_TK.stride(0), w_desc, xs_desc, gate_up_S2F, gate_up_S2F.stride(0), h_SF, h_SF.stride(0),
        sched.pair_S, sched.tile_expert, sched.tile_start, sched.ends_E, sched.num_experts, sched.num_tiles, S,
        two_f // 2, K, sched.top_k, x_sorted_SK is not None, NUM_STAGES=STAGES, PRODUCER_WARPS=PRODUCER_WARPS,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4))
