"""The DSA forward and the backward's dkv pass in Gluon, for Hopper (sm_90): the contracts of attention.py's
_fwd_kernel and _bwd_dkv_kernel, run in their place where `forward_fits` / `dkv_fits` say the shapes allow.

Shape legend: T tokens, H heads, K = V + R key width (V value, R rope), S selected keys; in-kernel tiles: BH heads,
BS keys (index slots) a step, BC value columns a block.

Why Gluon: Triton picks the shared-memory staging and the instruction order itself; Gluon states them.
- The forward's gathers run in a producer partition of their own (4 warps, few registers): cp.async of each step's
  selected kv rows into a two-stage shared-memory ring, handed to the two consumer warpgroups through mbarriers.
  Their warpgroup MMAs read the rows from shared memory (the Triton kernel loads the gathered rows into registers
  first), and they no longer hold the gather's addresses (168 registers a thread against 228-255).
- The dkv pass keeps one token's p and ds of BS slots in shared memory across every column block and loads the next
  block's q and dO while this block's atomics go out: it reads p and ds from L2 once, not once per column block.

On one H200 at T 32768, H 128, K 576 / V 512, S 2048 (bench/NOTES.md, ninth and tenth sessions): forward 47.7 ms
against the Triton kernel's 72.5, dkv pass 79.3 against 123.6; the results agree with the Triton kernels' to 1.2e-5
(o) and 4.9e-7 (dkv) relative RMS. The widths they take are the ones run on the H200 (value 256 and 512; rope 32
and 64 in the forward, 64 in the dkv pass) and those between. Under triton 3.5 (another warp_specialize signature)
the forward does not compile and the Triton kernel runs.

Gluon has no CPU interpreter: tests compile these kernels for sm_90a on any machine (registers, spills, shared
memory) and check their results against the fp64 reference where a Hopper GPU is. The Triton kernels stay the
path everywhere else and under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import functools
import warnings

import torch
import triton
from triton.compiler.errors import CompilationError

from runtime.kernels.launch import fast, interpreting

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, warpgroup_mma
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait
except ImportError:  # a triton without Gluon's Hopper modules: attention.py keeps its Triton kernels
    gluon = None

# Forward: one program per (token, FWD_HEADS heads), FWD_KEYS selected rows a step, FWD_STAGES of them in flight.
# 64 keys x 2 stages: 47.7 ms at 32768 tokens; 32 x 3 took 79, and issuing the next step's scores before this
# step's P V (FlashAttention-3's order) took 90 at 32 keys, the only width where it fits shared memory
# (bench/NOTES.md).
FWD_HEADS, FWD_KEYS, FWD_STAGES, FWD_WARPS = 64, 64, 2, 8
# The forward's gather partition: 4 warps at 64 registers (47.7 ms at 32768 tokens against 49.7 with the consumers
# gathering themselves; 2 warps at 88 registers 48.1, 4 at 48 48.1)
FWD_PRODUCER_WARPS, FWD_PRODUCER_REGS = 4, 64
# The dkv pass: one program per (token, DKV_SLOTS index slots), DKV_COLUMNS columns a block, 4-wide atomics
# (79 ms at 32768 tokens; 64 x 128 columns 87-91, 128 slots x 128 at 8 warps 88).
DKV_SLOTS, DKV_COLUMNS, DKV_WARPS = 64, 64, 4
# Hopper's shared memory a block can hold
SHARED_BYTES = 227 * 1024
LOG2E = 1.4426950408889634
# Gluon kernels that did not compile in this process: the Triton kernels run in their place
_failed: set[str] = set()


@functools.cache
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def _on_hopper(*tensors: torch.Tensor) -> bool:
    return (gluon is not None and not interpreting() and all(t.is_cuda for t in tensors)
            and _is_hopper(tensors[0].device.index or 0))


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def forward_fits(H: int, V: int, R: int, dtype: torch.dtype) -> bool:
    """Whether the Gluon forward's tiles take these shapes: bf16, whole 64-head blocks, power-of-two widths that one
    warpgroup MMA each spans (two warpgroups split V, so V / 2 <= 256), and q plus FWD_STAGES gathered steps in
    shared memory."""
    shared = 2 * (FWD_HEADS + FWD_STAGES * FWD_KEYS) * (V + R)
    return (dtype == torch.bfloat16 and H % FWD_HEADS == 0 and _power_of_two(V) and _power_of_two(R)
            and 128 <= V <= 512 and 32 <= R <= 256 and shared <= SHARED_BYTES)


def dkv_fits(H: int, V: int, R: int, S: int, dtype: torch.dtype) -> bool:
    """Whether the Gluon dkv pass's tiles take these shapes: bf16, whole 64-head and DKV_SLOTS-slot blocks (it
    reads p and ds without masks), V a multiple of the column block, a power-of-two rope width of one MMA, and p,
    ds, q, dO and q's rope block of all heads in shared memory."""
    shared = 2 * H * (2 * DKV_SLOTS + 2 * DKV_COLUMNS + R)
    return (dtype == torch.bfloat16 and H % 64 == 0 and S % DKV_SLOTS == 0 and V % DKV_COLUMNS == 0
            and _power_of_two(R) and 64 <= R <= 256 and shared <= SHARED_BYTES)


def use_forward(q_BTHK: torch.Tensor, kv_BTK: torch.Tensor, v_dim: int) -> bool:
    H, K = q_BTHK.shape[-2:]
    return (_on_hopper(q_BTHK, kv_BTK) and kv_BTK.dtype == q_BTHK.dtype
            and forward_fits(H, v_dim, K - v_dim, q_BTHK.dtype))


def use_dkv(q_BTHK: torch.Tensor, do_BTHV: torch.Tensor, S: int) -> bool:
    H, K = q_BTHK.shape[-2:]
    V = do_BTHV.shape[-1]
    return _on_hopper(q_BTHK, do_BTHV) and do_BTHV.dtype == q_BTHK.dtype and dkv_fits(H, V, K - V, S, q_BTHK.dtype)


if gluon is not None:
    # triton 3.6 calls these async_copy_global_to_shared and thread_barrier, 3.7 and later async_load and barrier
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier

    @gluon.jit
    def _load_indices(idx_ptr, tok, S, s0, BS: gl.constexpr, LAYOUT: gl.constexpr):
        """Index slots s0.. s0 + BS - 1 of one token, -1 past S."""
        offs_s = s0 + gl.arange(0, BS, layout=LAYOUT)
        return gl.load(idx_ptr + tok * S + offs_s, mask=offs_s < S, other=-1)

    @gluon.jit
    def _fwd_gather(kv_v_ring, kv_r_ring, full, empty, kv_ptr, idx_ptr, tok, T, S):
        """The forward's producer partition: cp.async of each step's selected kv rows into the stage the consumers
        released, arriving on full[stage] as its copies land; -1 slots read row 0, finite data whose logits are
        masked to -inf."""
        STAGES: gl.constexpr = kv_v_ring.shape[0]
        BS: gl.constexpr = kv_v_ring.shape[1]
        V: gl.constexpr = kv_v_ring.shape[2]
        R: gl.constexpr = kv_r_ring.shape[2]
        # V and R in pieces of CW columns: 16-byte vectors, CW / 8 threads along a row
        CW: gl.constexpr = 64 if R >= 64 else R
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (CW // 8), CW // 8], [gl.num_warps(), 1], [1, 0])
        offs_c = gl.arange(0, CW, layout=gl.SliceLayout(0, LOAD))
        for j in range(gl.cdiv(S, BS)):
            st = j % STAGES
            # the consumers' arrival after their last products from this stage (step j - STAGES)
            mbarrier.wait(empty.index(st), ((j // STAGES) - 1) & 1, pred=j >= STAGES)
            idx = _load_indices(idx_ptr, tok, S, j * BS, BS, gl.SliceLayout(1, LOAD))
            rows = ((tok // T) * T + gl.where(idx >= 0, idx, 0)).to(gl.int64) * (V + R)
            for c in gl.static_range(V // CW):
                _async_load(kv_v_ring.index(st).slice(c * CW, CW, dim=1),
                            kv_ptr + rows[:, None] + c * CW + offs_c[None, :])
            for c in gl.static_range(R // CW):
                _async_load(kv_r_ring.index(st).slice(c * CW, CW, dim=1),
                            kv_ptr + rows[:, None] + V + c * CW + offs_c[None, :])
            # each producer thread arrives once its own copies have landed
            async_copy.mbarrier_arrive(full.index(st), increment_count=False)

    @gluon.jit
    def _fwd_attend(q_v_smem, q_r_smem, kv_v_ring, kv_r_ring, full, empty, idx_ptr, o_ptr, lse_ptr, scale_log2, tok,
                    h0, H, S):
        """The forward's consumer partition, two warpgroups: they split a step's BS keys for S = q kv^T and the V
        value columns for O += P V; P goes to the MMA from registers."""
        BH: gl.constexpr = q_v_smem.shape[0]
        STAGES: gl.constexpr = kv_v_ring.shape[0]
        BS: gl.constexpr = kv_v_ring.shape[1]
        V: gl.constexpr = kv_v_ring.shape[2]
        S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, BS // 2, 16])
        O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, V // 2, 16])
        P_DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_MMA, k_width=2)
        m = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_MMA))
        l = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, S_MMA))
        o = gl.zeros([BH, V], gl.float32, layout=O_MMA)
        for j in range(gl.cdiv(S, BS)):
            st = j % STAGES
            # the slot mask loads before the wait for the stage, under it
            valid = _load_indices(idx_ptr, tok, S, j * BS, BS, gl.SliceLayout(0, S_MMA)) >= 0
            mbarrier.wait(full.index(st), (j // STAGES) & 1)
            # cp.async wrote through the generic proxy, the MMAs read through the async one
            fence_async_shared()
            kv_v = kv_v_ring.index(st)
            s = gl.zeros([BH, BS], gl.float32, layout=S_MMA)
            s = warpgroup_mma(q_v_smem, kv_v.permute((1, 0)), s, use_acc=False, is_async=True)
            s = warpgroup_mma(q_r_smem, kv_r_ring.index(st).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            logits = gl.where(valid[None, :], s * scale_log2, float("-inf"))
            m_new = gl.maximum(m, gl.max(logits, axis=1))
            # while no valid key has been seen m_new is -inf; shift by 0 to keep exp2 finite
            shift = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(logits - shift[:, None])
            alpha = gl.exp2(m - shift)
            l = l * alpha + gl.sum(p, axis=1)
            m = m_new
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_MMA))[:, None]
            o = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_DOT), kv_v, o, is_async=True)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
            # both warpgroups' products from this stage are done: one arrival hands it back to the producer
            _barrier()
            mbarrier.arrive(empty.index(st))

        has_keys = l > 0
        lse = gl.where(has_keys, m + gl.log2(gl.where(has_keys, l, 1.0)), float("inf"))
        inv_l = gl.convert_layout(1.0 / gl.where(has_keys, l, 1.0), gl.SliceLayout(1, O_MMA))
        offs_ho = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, O_MMA))
        offs_vo = gl.arange(0, V, layout=gl.SliceLayout(0, O_MMA))
        gl.store(o_ptr + (tok * H + offs_ho).to(gl.int64)[:, None] * V + offs_vo[None, :],
                 (o * inv_l[:, None]).to(gl.bfloat16))
        gl.store(lse_ptr + tok * H + h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, S_MMA)), lse)

    @gluon.jit
    def _fwd_kernel(q_ptr, kv_ptr, idx_ptr, o_ptr, lse_ptr, scale_log2, T, H, S,
                    V: gl.constexpr, R: gl.constexpr, BH: gl.constexpr, BS: gl.constexpr, STAGES: gl.constexpr,
                    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """o and the base-2 lse of BH heads of one token (attention._fwd_kernel's math): q in shared memory, then a
        producer partition gathers the selected kv rows into a ring of STAGES steps that the two consumer
        warpgroups (num_warps) attend over, handing stages back and forth through mbarriers."""
        K: gl.constexpr = V + R
        head_blocks = H // BH
        pid = gl.program_id(0)
        tok = (pid // head_blocks).to(gl.int64)
        h0 = (pid % head_blocks) * BH
        q_v_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, V],
                                             gl.NVMMASharedLayout.get_default_for([BH, V], gl.bfloat16))
        q_r_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, R],
                                             gl.NVMMASharedLayout.get_default_for([BH, R], gl.bfloat16))
        kv_v_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BS, V],
                                              gl.NVMMASharedLayout.get_default_for([BS, V], gl.bfloat16))
        kv_r_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BS, R],
                                              gl.NVMMASharedLayout.get_default_for([BS, R], gl.bfloat16))
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(full.index(st), count=32 * PRODUCER_WARPS)
            mbarrier.init(empty.index(st), count=1)
        # 16-byte vectors along the columns of q's rows
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        offs_h = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, LOAD))
        q_rows = (tok * H + offs_h).to(gl.int64) * K
        q_v_smem.store(gl.load(q_ptr + q_rows[:, None] + gl.arange(0, V, layout=gl.SliceLayout(0, LOAD))[None, :]))
        q_r_smem.store(gl.load(q_ptr + q_rows[:, None] + V
                               + gl.arange(0, R, layout=gl.SliceLayout(0, LOAD))[None, :]))
        fence_async_shared()
        _barrier()
        gl.warp_specialize([(_fwd_attend, (q_v_smem, q_r_smem, kv_v_ring, kv_r_ring, full, empty, idx_ptr, o_ptr,
                                           lse_ptr, scale_log2, tok, h0, H, S)),
                            (_fwd_gather, (kv_v_ring, kv_r_ring, full, empty, kv_ptr, idx_ptr, tok, T, S))],
                           [PRODUCER_WARPS], [PRODUCER_REGS])

    @gluon.jit
    def _load_tile(smem, ptr, row0, row_stride, col0, ROWS: gl.constexpr, COLS: gl.constexpr, LOAD: gl.constexpr):
        """cp.async of rows row0.. row0 + ROWS - 1, columns col0.. col0 + COLS - 1 of a row-major tensor."""
        rows = (row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LOAD))).to(gl.int64)
        cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, LOAD))
        _async_load(smem, ptr + rows[:, None] * row_stride + cols[None, :])

    @gluon.jit
    def _wait_tiles():
        """Every cp.async of this thread landed; then visible to the MMAs (async proxy) and to every thread."""
        async_copy.wait_group(0)
        fence_async_shared()
        _barrier()

    @gluon.jit
    def _add_rows(dkv_ptr, acc, rows, valid, col0, K: gl.constexpr, COLS: gl.constexpr, ADD: gl.constexpr):
        """Atomic adds of acc [slots, COLS] into the fp32 dkv rows, in the ADD layout (4 columns a thread: 4-wide
        atomics, at the cost of a layout conversion from the MMA's pairs)."""
        acc = gl.convert_layout(acc, ADD)
        rows = gl.convert_layout(rows, gl.SliceLayout(1, ADD))
        valid = gl.convert_layout(valid, gl.SliceLayout(1, ADD))
        cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, ADD))
        gl.atomic_add(dkv_ptr + rows[:, None] * K + cols[None, :], acc, mask=valid[:, None], sem="relaxed")

    @gluon.jit
    def _bwd_dkv_kernel(q_ptr, idx_ptr, do_ptr, p_ptr, ds_ptr, dkv_ptr, tok0, T, S, H: gl.constexpr,
                        V: gl.constexpr, R: gl.constexpr, BS: gl.constexpr, BC: gl.constexpr,
                        num_warps: gl.constexpr):
        """dkv of the BS selected rows of one token's index slots s0..: over all H heads at once (the heads are the
        products' reduction) (scale * ds)^T q + p^T dO for each block of BC value columns and (scale * ds)^T q for
        the rope block, each added into the fp32 dkv rows with atomics (several tokens select the same row)."""
        K: gl.constexpr = V + R
        num_slot_blocks = S // BS
        pid = gl.program_id(0)
        tok = tok0 + (pid // num_slot_blocks).to(gl.int64)
        s0 = (pid % num_slot_blocks) * BS

        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BC, 16])
        MMA_R: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, R, 16])
        ADD: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [num_warps, 1], [1, 0])
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [H, BS],
                                           gl.NVMMASharedLayout.get_default_for([H, BS], gl.bfloat16))
        ds_smem = gl.allocate_shared_memory(gl.bfloat16, [H, BS],
                                            gl.NVMMASharedLayout.get_default_for([H, BS], gl.bfloat16))
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [H, BC],
                                           gl.NVMMASharedLayout.get_default_for([H, BC], gl.bfloat16))
        do_smem = gl.allocate_shared_memory(gl.bfloat16, [H, BC],
                                            gl.NVMMASharedLayout.get_default_for([H, BC], gl.bfloat16))
        q_r_smem = gl.allocate_shared_memory(gl.bfloat16, [H, R],
                                             gl.NVMMASharedLayout.get_default_for([H, R], gl.bfloat16))

        # p and ds of this token's slots (the chunk's buffers are [chunk token, H, S]), q and dO of column block 0
        saved_row0 = (tok - tok0) * H
        _load_tile(p_smem, p_ptr, saved_row0, S, s0, H, BS, LOAD)
        _load_tile(ds_smem, ds_ptr, saved_row0, S, s0, H, BS, LOAD)
        _load_tile(q_smem, q_ptr, tok * H, K, 0, H, BC, LOAD)
        _load_tile(do_smem, do_ptr, tok * H, V, 0, H, BC, LOAD)
        async_copy.commit_group()

        offs_s = s0 + gl.arange(0, BS, layout=gl.SliceLayout(1, MMA))
        idx = gl.load(idx_ptr + tok * S + offs_s)
        valid = idx >= 0
        rows = ((tok // T) * T + gl.where(valid, idx, 0)).to(gl.int64)
        # the A operands, [BS slots, H heads]: transposed views of the [H, BS] tiles
        ds_t = ds_smem.permute((1, 0))
        p_t = p_smem.permute((1, 0))
        for c in gl.static_range(V // BC):
            _wait_tiles()
            acc = warpgroup_mma(ds_t, q_smem, gl.zeros([BS, BC], gl.float32, layout=MMA), use_acc=False,
                                is_async=True)
            acc = warpgroup_mma(p_t, do_smem, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            _barrier()
            # the next block's q and dO (after the last value block: q's rope columns) load under this block's adds
            if c + 1 < V // BC:
                _load_tile(q_smem, q_ptr, tok * H, K, (c + 1) * BC, H, BC, LOAD)
                _load_tile(do_smem, do_ptr, tok * H, V, (c + 1) * BC, H, BC, LOAD)
            else:
                _load_tile(q_r_smem, q_ptr, tok * H, K, V, H, R, LOAD)
            async_copy.commit_group()
            _add_rows(dkv_ptr, acc, rows, valid, c * BC, K, BC, ADD)
        _wait_tiles()
        acc_r = warpgroup_mma(ds_t, q_r_smem, gl.zeros([BS, R], gl.float32, layout=MMA_R), use_acc=False,
                              is_async=True)
        acc_r = warpgroup_mma_wait(num_outstanding=0, deps=(acc_r, ))
        _add_rows(dkv_ptr, acc_r, rows, valid, V, K, R, ADD)


def _compiles(name: str, launch) -> bool:
    """Runs launch() and returns True, or, where the Gluon kernel does not compile with the installed triton (Gluon
    is experimental: its calls move between releases), warns once, remembers it and returns False, so that the
    caller runs its Triton kernel: a moved API costs speed, not the run. Other errors propagate."""
    if name in _failed:
        return False
    try:
        launch()
    except (CompilationError, RuntimeError) as error:
        # MLIR pass failures surface as RuntimeError("PassManager::run failed"); CUDA errors must not be swallowed
        if not isinstance(error, CompilationError) and "PassManager" not in str(error):
            raise
        _failed.add(name)
        last_line = (str(error).strip().splitlines() or [""])[-1][:200]
        warnings.warn(f"the Gluon DSA {name} kernel does not compile with triton {triton.__version__} "
                      f"({type(error).__name__}: {last_line}); the Triton kernel runs instead", stacklevel=3)
        return False
    return True


def sparse_attention_fwd(q_BTHK, kv_BTK, idx_BTS, o_BTHV, lse_BTH, scale) -> bool:
    """attention.sparse_attention_fwd's kernel (use_forward must hold): writes o_BTHV and lse_BTH, or returns False
    where the kernel does not compile here (nothing written)."""
    B, T, H, K = q_BTHK.shape
    S, V = idx_BTS.shape[-1], o_BTHV.shape[-1]
    return _compiles("forward", lambda: fast(_fwd_kernel)[(B * T * (H // FWD_HEADS),)](
        q_BTHK, kv_BTK, idx_BTS, o_BTHV, lse_BTH, scale * LOG2E, T, H, S, V=V, R=K - V, BH=FWD_HEADS, BS=FWD_KEYS,
        STAGES=FWD_STAGES, PRODUCER_WARPS=FWD_PRODUCER_WARPS, PRODUCER_REGS=FWD_PRODUCER_REGS,
        num_warps=FWD_WARPS))


def dkv_pass(q_BTHK, idx_BTS, do_BTHV, p_CHS, ds_CHS, dkv32_BTK, tok0, num_tokens) -> bool:
    """The dkv pass of the chunk of num_tokens tokens from tok0 (use_dkv must hold): adds into dkv32_BTK, or returns
    False where the kernel does not compile here (nothing added)."""
    _, T, H, K = q_BTHK.shape
    S, V = idx_BTS.shape[-1], do_BTHV.shape[-1]
    return _compiles("dkv", lambda: fast(_bwd_dkv_kernel)[(num_tokens * (S // DKV_SLOTS),)](
        q_BTHK, idx_BTS, do_BTHV, p_CHS, ds_CHS, dkv32_BTK, tok0, T, S, H=H, V=V, R=K - V, BS=DKV_SLOTS,
        BC=DKV_COLUMNS, num_warps=DKV_WARPS))
