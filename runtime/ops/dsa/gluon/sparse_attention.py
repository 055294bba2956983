"""The DSA forward and the backward's dkv pass in Gluon, for Hopper (sm_90): the contracts of attention.py's
_fwd_kernel and _bwd_dkv_kernel, run in their place where `forward_fits` / `dkv_fits` say the shapes allow.

Shape legend: T tokens, H heads, K = V + R key width (V value, R rope), S selected keys; in-kernel tiles: BH heads,
BS keys (index slots) a block, BC value columns a block.

Why Gluon: Triton picks the shared-memory staging and the instruction order itself; Gluon states them.
- The forward runs FlashMLA's Hopper schedule (deepseek-ai/FlashMLA, its sparse prefill; re-derived, no code taken):
  two 64-key blocks an iteration, one per consumer warpgroup, each warpgroup holding half of O's value columns, so
  that each block's S is one warpgroup's and the two exchange only their row max and P. A producer partition
  gathers q and the selected kv rows with cp.async; each slot's rows sit in two halves with their own mbarriers, so
  that a half is refilled as soon as its last reader is done, and warpgroup 0 issues the next pair's first scores
  under its last P V.
- The dkv pass keeps one token's p and ds of BS slots in shared memory across every column block and loads the next
  block's q and dO while this block's atomics go out: it reads p and ds from L2 once, not once per column block.

o agrees with the Triton kernel's to 5.2e-4 relative RMS (the two warpgroups sum P V in another order), dkv to
4.9e-7. The widths they take are the ones checked on a Hopper GPU (value 256 and 512; rope 32 and 64 in the
forward, 64 in the dkv pass) and those between. Where the installed triton's warp_specialize takes another
signature the forward does not compile and the Triton kernel runs (common/gluon_fallback.py).

Gluon has no CPU interpreter: tests compile these kernels for sm_90a on any machine (register and shared memory
use) and check their results against the fp64 reference where a Hopper GPU is. The Triton kernels stay the
path everywhere else and under TRITON_INTERPRET=1.
"""
from __future__ import annotations


import torch

from runtime.ops.common.gluon_fallback import compiles
from runtime.ops.common.launch import fast
from runtime.ops.dsa.backend import SELECTOR

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, warpgroup_mma
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait
except ImportError:  # a triton without Gluon's Hopper modules: attention.py keeps its Triton kernels
    gluon = None

# Forward: one program per (token, FWD_HEADS heads), two blocks of FWD_KEYS selected rows (a pair) an iteration, one
# block per consumer warpgroup, FlashMLA's schedule: faster than each block's keys and value columns split between
# the warpgroups.
FWD_HEADS, FWD_KEYS = 64, 64
# warpgroup 1's registers and the gather partition's warps; warpgroup 0 takes what the producer leaves (see
# forward_producer_regs). 216 is the most that leaves warpgroup 0 its live values at V 512; 2 producer warps with
# more registers each were slower
FWD_WG1_REGS, FWD_PRODUCER_WARPS = 216, 4
# The dkv pass: one program per (token, DKV_SLOTS index slots), DKV_COLUMNS columns a block, 4-wide atomics
# (the fastest of the blockings tried, ahead of 64 x 128 columns and 128 slots x 128 at 8 warps).
DKV_SLOTS, DKV_COLUMNS, DKV_WARPS = 64, 64, 4
# Hopper's shared memory a block can hold
SHARED_BYTES = 227 * 1024
LOG2E = 1.4426950408889634


def _on_hopper(*tensors: torch.Tensor) -> bool:
    return (gluon is not None and all(t.is_cuda for t in tensors)
            and SELECTOR.choose(tensors[0].device) == "hopper")


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def forward_producer_regs(V: int) -> int:
    """The forward's gather partition's registers a thread. At V 512 each consumer's O accumulator is 128 of its
    registers and warpgroup 0 needs 256, which leaves the producer 40; narrower accumulators leave it 48 (40 is too
    few for the producer at V 256)."""
    return 40 if V > 256 else 48


def forward_fits(H: int, V: int, R: int, dtype: torch.dtype) -> bool:
    """Whether the Gluon forward's tiles take these shapes: bf16, whole 64-head blocks, power-of-two widths that one
    warpgroup MMA each spans (each warpgroup holds half of V, so V / 2 <= 256), and q, the two slots of a pair and
    the exchanged P blocks in shared memory (P_A lives in slot 0's rope rows where R is a block's width)."""
    p_blocks = 1 if R == FWD_KEYS else 2
    shared = 2 * ((FWD_HEADS + 2 * FWD_KEYS) * (V + R) + p_blocks * FWD_HEADS * FWD_KEYS) + 4 * 4 * FWD_HEADS
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

    # The forward's mbarriers: the four kv halves' full (the producer's copies landed) and free (their last reader
    # is done) pairs, then the consumers' hand-offs: row maxes, P, and each warpgroup's final row sums; q landed.
    FULL_L0, FULL_L1, FULL_R0, FULL_R1 = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2), gl.constexpr(3)
    FREE_L0, FREE_L1, FREE_R0, FREE_R1 = gl.constexpr(4), gl.constexpr(5), gl.constexpr(6), gl.constexpr(7)
    MAX0, MAX1, P0_READY, P1_READY, P1_FREE = (gl.constexpr(8), gl.constexpr(9), gl.constexpr(10), gl.constexpr(11),
                                              gl.constexpr(12))
    SUM0, SUM1, Q_FULL, NUM_FWD_BARRIERS = gl.constexpr(13), gl.constexpr(14), gl.constexpr(15), gl.constexpr(16)

    @gluon.jit
    def _wait(bars, which: gl.constexpr, phase, pred=True):
        mbarrier.wait(bars.index(which), phase & 1, pred=pred)

    @gluon.jit
    def _signal(bars, which: gl.constexpr):
        # every thread of the partition is past its reads or writes before the one arrival
        _barrier()
        mbarrier.arrive(bars.index(which))

    @gluon.jit
    def _shift(m):
        # while no valid key has been seen the row max is -inf: shift by 0 to keep exp2 finite
        return gl.where(m == float("-inf"), 0.0, m)

    @gluon.jit
    def _kv_rows(idx_ptr, tok, T, S, s0, K: gl.constexpr, BS: gl.constexpr, LAYOUT: gl.constexpr):
        """Element offsets of the kv rows that index slots s0.. s0 + BS - 1 select; -1 slots read row 0, finite data
        whose logits the consumers mask to -inf."""
        idx = _load_indices(idx_ptr, tok, S, s0, BS, LAYOUT)
        return ((tok // T) * T + gl.where(idx >= 0, idx, 0)).to(gl.int64) * K

    @gluon.jit
    def _gather(kv_ptr, rows, dst, col0, CW: gl.constexpr, LOAD: gl.constexpr):
        """cp.async of columns col0.. of the kv rows at element offsets `rows` into dst, CW columns a copy."""
        offs_c = gl.arange(0, CW, layout=gl.SliceLayout(0, LOAD))
        for c in gl.static_range(dst.shape[1] // CW):
            _async_load(dst.slice(c * CW, CW, dim=1), kv_ptr + rows[:, None] + col0 + c * CW + offs_c[None, :])

    @gluon.jit
    def _fwd_producer(q_l, q_r, q_p, kv_l, kv_r, kv_p, p_a, p_b, s_m0, s_m1, s_l0, s_l1, bars, q_ptr, kv_ptr,
                      idx_ptr, o_ptr, lse_ptr, scale_log2, tok, h0, T, H, S, zero):
        """The forward's producer partition: q's rows, then for each pair of key blocks (A in slot 0, B in slot 1),
        cp.async of each half of their selected kv rows as soon as its last reader has freed it, in the order they
        free: A's left half, B's right, A's right, B's left. Each producer thread arrives on the half's full barrier
        once its copies have landed."""
        BS: gl.constexpr = kv_l.shape[1]
        HALF: gl.constexpr = kv_l.shape[2]
        R: gl.constexpr = kv_p.shape[2]
        # 16-byte vectors, pieces of CW columns that divide both the value halves and the rope
        CW: gl.constexpr = 64 if R >= 64 else R
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (CW // 8), CW // 8], [gl.num_warps(), 1], [1, 0])
        K: gl.constexpr = 2 * HALF + R
        # q by cp.async too, so that its latency and the first pair's overlap
        q_rows = (tok * H + h0 + gl.arange(0, q_l.shape[1], layout=gl.SliceLayout(1, LOAD))).to(gl.int64) * K
        _gather(q_ptr, q_rows, q_l.index(0), 0, CW, LOAD)
        _gather(q_ptr, q_rows, q_r.index(0), HALF, CW, LOAD)
        _gather(q_ptr, q_rows, q_p.index(0), 2 * HALF, CW, LOAD)
        async_copy.mbarrier_arrive(bars.index(Q_FULL), increment_count=False)
        for i in range(gl.cdiv(S, 2 * BS)):
            rows_a = _kv_rows(idx_ptr, tok, T, S, 2 * i * BS, K, BS, gl.SliceLayout(1, LOAD))
            rows_b = _kv_rows(idx_ptr, tok, T, S, (2 * i + 1) * BS, K, BS, gl.SliceLayout(1, LOAD))
            _wait(bars, FREE_L0, i - 1, pred=i > 0)
            _gather(kv_ptr, rows_a, kv_l.index(0), 0, CW, LOAD)
            async_copy.mbarrier_arrive(bars.index(FULL_L0), increment_count=False)
            _wait(bars, FREE_R1, i - 1, pred=i > 0)
            _gather(kv_ptr, rows_b, kv_r.index(1), HALF, CW, LOAD)
            _gather(kv_ptr, rows_b, kv_p.index(1), 2 * HALF, CW, LOAD)
            async_copy.mbarrier_arrive(bars.index(FULL_R1), increment_count=False)
            _wait(bars, FREE_R0, i - 1, pred=i > 0)
            _gather(kv_ptr, rows_a, kv_r.index(0), HALF, CW, LOAD)
            _gather(kv_ptr, rows_a, kv_p.index(0), 2 * HALF, CW, LOAD)
            async_copy.mbarrier_arrive(bars.index(FULL_R0), increment_count=False)
            _wait(bars, FREE_L1, i - 1, pred=i > 0)
            _gather(kv_ptr, rows_b, kv_l.index(1), 0, CW, LOAD)
            async_copy.mbarrier_arrive(bars.index(FULL_L1), increment_count=False)

    @gluon.jit
    def _scores_left(q_l, kv_l, s, use_acc: gl.constexpr):
        return warpgroup_mma(q_l, kv_l.permute((1, 0)), s, use_acc=use_acc, is_async=True)

    @gluon.jit
    def _scores_right(q_r, q_p, kv_r, kv_p, s, use_acc: gl.constexpr):
        s = warpgroup_mma(q_r, kv_r.permute((1, 0)), s, use_acc=use_acc, is_async=True)
        return warpgroup_mma(q_p, kv_p.permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _store_o(o, l, o_ptr, tok, h0, H, col0, V: gl.constexpr, O_MMA: gl.constexpr):
        """o / l of this warpgroup's value columns col0.. of BH heads; rows without keys stay 0."""
        BH: gl.constexpr = o.shape[0]
        inv_l = gl.convert_layout(1.0 / gl.where(l > 0, l, 1.0), gl.SliceLayout(1, O_MMA))
        offs_h = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, O_MMA))
        offs_v = col0 + gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, O_MMA))
        gl.store(o_ptr + (tok * H + offs_h).to(gl.int64)[:, None] * V + offs_v[None, :],
                 (o * inv_l[:, None]).to(gl.bfloat16))

    @gluon.jit
    def _fwd_warpgroup0(q_l, q_r, q_p, kv_l, kv_r, kv_p, p_a, p_b, s_m0, s_m1, s_l0, s_l1, bars, q_ptr, kv_ptr,
                        idx_ptr, o_ptr, lse_ptr, scale_log2, tok, h0, T, H, S, zero):
        """Block A of each pair and the left value half of O: S_A (its left batch first: this warpgroup frees A's
        left half itself), the softmax of A, P_A V_A[:, left] from registers; after warpgroup 1's row max, P_A
        rescaled into p_a for warpgroup 1, then P_B V_B[:, left] with P_B from shared memory, the next pair's left
        S batch issued under it."""
        BH: gl.constexpr = q_l.shape[1]
        BS: gl.constexpr = kv_l.shape[1]
        HALF: gl.constexpr = kv_l.shape[2]
        S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BS, 16])
        O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF, 16])
        P_DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_MMA, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, S_MMA)
        pairs = gl.cdiv(S, 2 * BS)
        m = gl.full([BH], float("-inf"), gl.float32, layout=ROW)
        l = gl.zeros([BH], gl.float32, layout=ROW)
        o = gl.zeros([BH, HALF], gl.float32, layout=O_MMA)
        s = gl.zeros([BH, BS], gl.float32, layout=S_MMA)
        _wait(bars, Q_FULL, 0)
        _wait(bars, FULL_L0, 0)
        # cp.async wrote through the generic proxy, the MMAs read through the async one
        fence_async_shared()
        s = _scores_left(q_l.index(0), kv_l.index(0), s, False)
        _wait(bars, FULL_R0, 0)
        fence_async_shared()
        s = _scores_right(q_r.index(0), q_p.index(0), kv_r.index(0), kv_p.index(0), s, True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        for i in range(pairs):
            # shared-memory views indexed by a runtime 0: with constant views the compiler hoists every MMA
            # descriptor of the loop out of it, where they do not fit in registers
            z = i * zero
            valid = _load_indices(idx_ptr, tok, S, 2 * i * BS, BS, gl.SliceLayout(0, S_MMA)) >= 0
            logits = gl.where(valid[None, :], s * scale_log2, float("-inf"))
            m_a = gl.maximum(m, gl.max(logits, axis=1))
            p = gl.exp2(logits - _shift(m_a)[:, None])
            alpha = gl.exp2(m - _shift(m_a))
            l = l * alpha + gl.sum(p, axis=1)
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_MMA))[:, None]
            s_m0.store(m_a)
            _signal(bars, MAX0)
            p16 = p.to(gl.bfloat16)
            o = warpgroup_mma(gl.convert_layout(p16, P_DOT), kv_l.index(z), o, is_async=True)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
            _signal(bars, FREE_L0)
            # warpgroup 1's max over A and B: this pair's max
            _wait(bars, MAX1, i)
            m_new = s_m1.load(ROW)
            c = gl.exp2(m_a - _shift(m_new))
            # P_A stays bf16 as the product above took it, rescaled in fp32 and rounded again for warpgroup 1
            p16 = (p16.to(gl.float32) * c[:, None]).to(gl.bfloat16)
            l = l * c
            o = o * gl.convert_layout(c, gl.SliceLayout(1, O_MMA))[:, None]
            m = m_new
            p_a.index(z).store(p16)
            fence_async_shared()
            _signal(bars, P0_READY)
            _wait(bars, P1_READY, i)
            _wait(bars, FULL_L1, i)
            fence_async_shared()
            o_pending = warpgroup_mma(p_b.index(z), kv_l.index(z + 1), o, is_async=True)
            if i + 1 < pairs:
                # the next pair's left batch goes out under this last product
                _wait(bars, FULL_L0, i + 1)
                fence_async_shared()
                s = _scores_left(q_l.index(z), kv_l.index(z), s, False)
                o = warpgroup_mma_wait(num_outstanding=1, deps=(o_pending, ))
                _signal(bars, FREE_L1)
                _signal(bars, P1_FREE)
                _wait(bars, FULL_R0, i + 1)
                fence_async_shared()
                s = _scores_right(q_r.index(z), q_p.index(z), kv_r.index(z), kv_p.index(z), s, True)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            else:
                o = warpgroup_mma_wait(num_outstanding=0, deps=(o_pending, ))
                _signal(bars, FREE_L1)
                _signal(bars, P1_FREE)
        s_l0.store(l)
        _signal(bars, SUM0)
        _wait(bars, SUM1, 0)
        l = l + s_l1.load(ROW)
        _store_o(o, l, o_ptr, tok, h0, H, 0, 2 * HALF, O_MMA)
        lse = gl.where(l > 0, m + gl.log2(gl.where(l > 0, l, 1.0)), float("inf"))
        gl.store(lse_ptr + tok * H + h0 + gl.arange(0, BH, layout=ROW), lse)

    @gluon.jit
    def _fwd_warpgroup1(q_l, q_r, q_p, kv_l, kv_r, kv_p, p_a, p_b, s_m0, s_m1, s_l0, s_l1, bars, q_ptr, kv_ptr,
                        idx_ptr, o_ptr, lse_ptr, scale_log2, tok, h0, T, H, S, zero):
        """Block B of each pair and the right value half of O: S_B (its right batch first: this warpgroup frees
        B's right half itself), the softmax of B against warpgroup 0's max over A, P_B V_B[:, right] from
        registers and P_B into p_b for warpgroup 0, then P_A V_A[:, right] with P_A from p_a."""
        BH: gl.constexpr = q_l.shape[1]
        BS: gl.constexpr = kv_l.shape[1]
        HALF: gl.constexpr = kv_l.shape[2]
        S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BS, 16])
        O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF, 16])
        P_DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_MMA, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, S_MMA)
        m = gl.full([BH], float("-inf"), gl.float32, layout=ROW)
        l = gl.zeros([BH], gl.float32, layout=ROW)
        o = gl.zeros([BH, HALF], gl.float32, layout=O_MMA)
        _wait(bars, Q_FULL, 0)
        for i in range(gl.cdiv(S, 2 * BS)):
            z = i * zero
            valid = _load_indices(idx_ptr, tok, S, (2 * i + 1) * BS, BS, gl.SliceLayout(0, S_MMA)) >= 0
            _wait(bars, FULL_R1, i)
            fence_async_shared()
            s = _scores_right(q_r.index(z), q_p.index(z), kv_r.index(z + 1), kv_p.index(z + 1),
                              gl.zeros([BH, BS], gl.float32, layout=S_MMA), False)
            _wait(bars, FULL_L1, i)
            fence_async_shared()
            s = _scores_left(q_l.index(z), kv_l.index(z + 1), s, True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            logits = gl.where(valid[None, :], s * scale_log2, float("-inf"))
            _wait(bars, MAX0, i)
            m_new = gl.maximum(s_m0.load(ROW), gl.max(logits, axis=1))
            p = gl.exp2(logits - _shift(m_new)[:, None])
            alpha = gl.exp2(m - _shift(m_new))
            l = l * alpha + gl.sum(p, axis=1)
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_MMA))[:, None]
            m = m_new
            s_m1.store(m_new)
            _signal(bars, MAX1)
            p16 = p.to(gl.bfloat16)
            p_dot = gl.convert_layout(p16, P_DOT)
            o = warpgroup_mma(p_dot, kv_r.index(z + 1), o, is_async=True)
            # warpgroup 0 has read the last pair's P_B
            _wait(bars, P1_FREE, i - 1, pred=i > 0)
            p_b.index(z).store(p16)
            fence_async_shared()
            _wait(bars, P0_READY, i)
            _wait(bars, FULL_R0, i)
            fence_async_shared()
            o = warpgroup_mma(p_a.index(z), kv_r.index(z), o, is_async=True)
            _signal(bars, P1_READY)
            # P_B's registers feed the first of the two products in flight: kept alive until it is done
            o, p_dot = warpgroup_mma_wait(num_outstanding=1, deps=(o, p_dot))
            _signal(bars, FREE_R1)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
            _signal(bars, FREE_R0)
        s_l1.store(l)
        _signal(bars, SUM1)
        _wait(bars, SUM0, 0)
        l = l + s_l0.load(ROW)
        _store_o(o, l, o_ptr, tok, h0, H, HALF, 2 * HALF, O_MMA)

    @gluon.jit
    def _fwd_kernel(q_ptr, kv_ptr, idx_ptr, o_ptr, lse_ptr, scale_log2, T, H, S, zero,
                    V: gl.constexpr, R: gl.constexpr, BH: gl.constexpr, BS: gl.constexpr, WG1_REGS: gl.constexpr,
                    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """o and the base-2 lse of BH heads of one token (attention._fwd_kernel's math), two blocks of BS selected
        keys (a pair) an iteration, in three partitions: warpgroup 0 (this one, num_warps 4) takes block A and
        value columns 0.. V / 2 - 1, warpgroup 1 block B and the other half, the producer gathers q and the kv
        rows. Each slot's kv rows sit in two halves with their own barriers, L (the left value columns) and R (the
        right value columns and the rope), so that the producer refills a half as soon as its last reader is done.
        `zero` is 0."""
        HALF: gl.constexpr = V // 2
        head_blocks = H // BH
        pid = gl.program_id(0)
        tok = (pid // head_blocks).to(gl.int64)
        h0 = (pid % head_blocks) * BH
        HALF_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, HALF], gl.bfloat16)
        ROPE_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, R], gl.bfloat16)
        P_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BS], gl.bfloat16)
        VEC_L: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        # q and each slot's halves carry a leading index so that the consumers index every view at run time
        q_l = gl.allocate_shared_memory(gl.bfloat16, [1, BH, HALF], HALF_L)
        q_r = gl.allocate_shared_memory(gl.bfloat16, [1, BH, HALF], HALF_L)
        q_p = gl.allocate_shared_memory(gl.bfloat16, [1, BH, R], ROPE_L)
        kv_l = gl.allocate_shared_memory(gl.bfloat16, [2, BS, HALF], HALF_L)
        kv_r = gl.allocate_shared_memory(gl.bfloat16, [2, BS, HALF], HALF_L)
        kv_p = gl.allocate_shared_memory(gl.bfloat16, [2, BS, R], ROPE_L)
        p_b = gl.allocate_shared_memory(gl.bfloat16, [1, BH, BS], P_L)
        if R == BS:
            # P_A goes into slot 0's rope rows, free once S_A (their other reader) is done: 8 KB the widest q and
            # two slots leave no room for
            p_a = kv_p
        else:
            p_a = gl.allocate_shared_memory(gl.bfloat16, [1, BH, BS], P_L)
        s_m0 = gl.allocate_shared_memory(gl.float32, [BH], VEC_L)
        s_m1 = gl.allocate_shared_memory(gl.float32, [BH], VEC_L)
        s_l0 = gl.allocate_shared_memory(gl.float32, [BH], VEC_L)
        s_l1 = gl.allocate_shared_memory(gl.float32, [BH], VEC_L)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_FWD_BARRIERS, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(NUM_FWD_BARRIERS):
            # the full barriers and q's take one arrival per producer thread
            mbarrier.init(bars.index(b), count=32 * PRODUCER_WARPS if b < 4 or b == Q_FULL else 1)
        fence_async_shared()
        _barrier()
        args = (q_l, q_r, q_p, kv_l, kv_r, kv_p, p_a, p_b, s_m0, s_m1, s_l0, s_l1, bars, q_ptr, kv_ptr, idx_ptr,
                o_ptr, lse_ptr, scale_log2, tok, h0, T, H, S, zero)
        gl.warp_specialize([(_fwd_warpgroup0, args), (_fwd_warpgroup1, args), (_fwd_producer, args)],
                           [4, PRODUCER_WARPS], [WG1_REGS, PRODUCER_REGS])

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


def sparse_attention_fwd(q_BTHK, kv_BTK, idx_BTS, o_BTHV, lse_BTH, scale) -> bool:
    """attention.sparse_attention_fwd's kernel (use_forward must hold): writes o_BTHV and lse_BTH, or returns False
    where the kernel does not compile here (nothing written)."""
    B, T, H, K = q_BTHK.shape
    S, V = idx_BTS.shape[-1], o_BTHV.shape[-1]
    # `zero` (0) indexes the consumers' shared-memory views at run time (see _fwd_warpgroup0)
    return compiles("DSA forward", lambda: fast(_fwd_kernel)[(B * T * (H // FWD_HEADS),)](
        q_BTHK, kv_BTK, idx_BTS, o_BTHV, lse_BTH, scale * LOG2E, T, H, S, 0, V=V, R=K - V, BH=FWD_HEADS, BS=FWD_KEYS,
        WG1_REGS=FWD_WG1_REGS, PRODUCER_WARPS=FWD_PRODUCER_WARPS, PRODUCER_REGS=forward_producer_regs(V),
        num_warps=4))


def dkv_pass(q_BTHK, idx_BTS, do_BTHV, p_CHS, ds_CHS, dkv32_BTK, tok0, num_tokens) -> bool:
    """The dkv pass of the chunk of num_tokens tokens from tok0 (use_dkv must hold): adds into dkv32_BTK, or returns
    False where the kernel does not compile here (nothing added)."""
    _, T, H, K = q_BTHK.shape
    S, V = idx_BTS.shape[-1], do_BTHV.shape[-1]
    return compiles("DSA dkv", lambda: fast(_bwd_dkv_kernel)[(num_tokens * (S // DKV_SLOTS),)](
        q_BTHK, idx_BTS, do_BTHV, p_CHS, ds_CHS, dkv32_BTK, tok0, T, S, H=H, V=V, R=K - V, BS=DKV_SLOTS,
        BC=DKV_COLUMNS, num_warps=DKV_WARPS))
