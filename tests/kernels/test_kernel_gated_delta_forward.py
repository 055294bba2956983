"""Forward pieces of the GDN/KDA Triton kernels under TRITON_INTERPRET=1 that the op-level tests
(tests/test_kernel_gated_delta.py, K=16) do not reach: the unit lower inverse (I + L)^-1 by doubling on
the diagonal blocks and level-by-level merging at the real chunk size, against an fp64 solve, on keys
drawn at random and on keys that repeat (where the doubling's partial products cancel); prep over
column blocks and in two launches; and o from the forward scan (KernelVariant.scan_output) instead of
output_kernel.

Shape legend: T tokens, H heads, C chunk size, S sub-chunk size, K key dim, V value dim.
"""
import os
from dataclasses import replace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import runtime.kernels.gated_delta as kernels  # noqa: E402
import runtime.kernels.gated_delta.function as kernel_config  # noqa: E402
from reference_ops.gated_delta import gated_delta_rule as ref_gdn  # noqa: E402
from reference_ops.kda import kda as ref_kda  # noqa: E402
from runtime.kernels.gated_delta.common import (  # noqa: E402
    block_diagonal, diag_block_inverse, merge_block_inverse,
)
from runtime.kernels.gated_delta.function import (  # noqa: E402
    FP32_TILES, SCALAR_DECAY_DEFAULT, KernelVariant,
)
from runtime.tolerances import assert_close  # noqa: E402
from tests.kernels.test_kernel_gated_delta import VARIANTS, check, make_inputs  # noqa: E402

pytestmark = pytest.mark.interpreter


@triton.jit
def inverse_kernel(l_ptr, t_ptr, C: tl.constexpr, S: tl.constexpr):
    """As prep_blocked_kernel inverts: the diagonal blocks as a [C / S, S, S] batch, then the merges."""
    rows = tl.arange(0, C)
    offs = rows[:, None] * C + rows[None, :]
    l_CC = tl.load(l_ptr + offs)
    blk, ii = tl.arange(0, C // S), tl.arange(0, S)
    l_BSS = tl.load(l_ptr + ((blk * S)[:, None, None] + ii[None, :, None]) * C + (blk * S)[:, None, None]
                    + ii[None, None, :])
    td_CC = block_diagonal(diag_block_inverse(l_BSS, S, "tf32x3"), C, S)
    tl.store(t_ptr + offs, merge_block_inverse(l_CC, td_CC, C, S, "tf32"))


def strictly_lower_gram(k_CK, beta_C, g_C):
    """beta_i exp(g_i - g_j) k_i . k_j for j < i, as the prep kernels build L (fp64)."""
    k_hat = torch.nn.functional.normalize(k_CK, dim=-1)
    decay = torch.exp(g_C[:, None] - g_C[None, :])
    return torch.tril(beta_C[:, None] * (k_hat @ k_hat.T) * decay, -1)


@pytest.mark.parametrize("keys", ["random", "repeated"])
def test_unit_lower_inverse_by_doubling_and_merging(keys):
    C, S, K = 64, 16, 128
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(C, K, generator=gen, dtype=torch.float64)
    if keys == "repeated":
        # every token of a sub-chunk nearly the same key: L's blocks near all-ones, powers up to C(14, 7)
        k = k[::S].repeat_interleave(S, 0) + 0.01 * torch.randn(C, K, generator=gen, dtype=torch.float64)
    beta = torch.rand(C, generator=gen, dtype=torch.float64) * 0.5 + 0.5
    g = torch.cumsum(-0.05 * torch.rand(C, generator=gen, dtype=torch.float64), 0)
    l_CC = strictly_lower_gram(k, beta, g)
    expected = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + l_CC)
    got = torch.empty(C, C)
    inverse_kernel[(1,)](l_CC.float(), got, C=C, S=S)
    rel = (got.double() - expected).norm() / expected.norm()
    # tf32 merges (~5e-4 per product) bound the error; the doubling's tf32x3 keeps its own near fp32
    assert rel < 2e-3, rel


@pytest.fixture
def chunk32_nan_buffers(monkeypatch):
    """Chunk 32 in sub-chunks of 16 and NaN-filled buffers, as in tests/test_kernel_gated_delta.py."""
    monkeypatch.setattr(kernel_config, "CHUNK_SIZE", 32)
    monkeypatch.setattr(kernel_config, "SUB_CHUNK", 16)
    monkeypatch.setattr(kernel_config, "empty", lambda *s, dtype, device: torch.full(s, float("nan"), dtype=dtype,
                                                                                      device=device))


@pytest.mark.parametrize("K,V", [(32, 16), (16, 32)], ids=["K32-V16", "K16-V32"])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_column_blocks(kind, K, V, chunk32_nan_buffers):
    """prep_blocked_kernel over two column blocks of K (or of V: its blocks are min(64, K, V) wide), which
    the main tests (K = V = 16) do not reach: o and the final state over three packed sequences with
    initial states vs the fp64 reference, at the bf16 bar (bf16 tiles and states)."""
    T, H = 63, 2
    gen = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    g = F.logsigmoid(rand(1, T, H, K) if kind == "kda" else rand(1, T, H))
    args = [rand(1, T, H, K), rand(1, T, H, K), rand(1, T, H, V), g, torch.sigmoid(rand(1, T, H))]
    kw = dict(initial_state_BHKV=rand(3, H, K, V), cu_seqlens=torch.tensor([0, 5, 40, 63]))
    op, ref = {"gdn": ("gated_delta_rule", ref_gdn), "kda": ("kda", ref_kda)}[kind]
    with torch.no_grad():
        o, state = getattr(kernels, op)(*args, **kw, variant=KernelVariant())
    o_ref, state_ref = ref(*[a.double() for a in args], initial_state_BHKV=kw["initial_state_BHKV"].double(),
                           cu_seqlens=kw["cu_seqlens"])
    assert_close(o, o_ref, op, torch.bfloat16, name="o")
    assert_close(state, state_ref, op, torch.bfloat16, name="final_state")


@pytest.mark.parametrize("column_block", [16, 32], ids=["two-key-blocks", "one-key-block"])
def test_split_prep_stores_what_one_launch_does(column_block, monkeypatch):
    """KernelVariant.split_prep (the column kernel reading the first launch's Tinv and inverse norms) stores the
    quantities the backward reads (P, Tinv, w, u, qg, kbar, gc_last) as the one-launch prep does, up to fp32
    rounding: the benchmark's chunk 64 in sub-chunks of 16, K=32 in column blocks of 16 or 32, strong decays
    (up to ~-15 per token), three packed sequences."""
    monkeypatch.setattr(kernel_config, "CHUNK_SIZE", 64)
    monkeypatch.setattr(kernel_config, "empty", lambda *s, dtype, device: torch.full(s, float("nan"), dtype=dtype,
                                                                                      device=device))
    T, H, K, V = 150, 2, 32, 16
    gen = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = rand(T, H, K), rand(T, H, K), rand(T, H, V)
    g, beta = 15.0 * F.logsigmoid(rand(T, H, K) + 1.0), torch.sigmoid(rand(T, H))
    layout = kernel_config.ChunkLayout.packed(torch.tensor([0, 5, 70, 150]), 64)
    fp32 = dict(bf16_tiles=False, bf16_states=False)
    args = (q, k, v, g, beta, layout, K**-0.5, True, True, True)
    expected = kernel_config._prep(*args, KernelVariant(token_parallel_diag=True, **fp32))
    got = kernel_config._prep(*args, KernelVariant(token_parallel_diag=True, split_prep=True,
                                                    prep_column_block=column_block, **fp32))
    for name, e in expected.items():
        assert torch.isfinite(got[name]).all(), name
        torch.testing.assert_close(got[name], e, rtol=1e-4, atol=1e-5, msg=name)


# GDN's default has scan_output on (KDA's too: tests/test_kernel_kda_diagonal.py runs it as "kda_default")
SCAN_OUTPUT = {"gdn": SCALAR_DECAY_DEFAULT,
               # two value blocks per head at V=32: o's columns at the block's offset
               "fp32_tiles": replace(FP32_TILES, scan_output=True, scan_value_block=16)}


@pytest.mark.parametrize("kind,variant", [("gdn", "gdn"), ("gdn", "fp32_tiles")], ids=["gdn", "gdn-fp32_tiles"])
def test_scan_output_cu_seqlens(kind, variant, chunk32_nan_buffers, monkeypatch):
    """KernelVariant.scan_output (o from the forward scan, no output_kernel) on GDN's default (bf16 tiles) and on
    fp32 tiles, forward and backward vs the fp64 reference: three packed sequences (the last chunks partial) with
    initial states."""
    monkeypatch.setitem(VARIANTS, "scan_output", SCAN_OUTPUT[variant])
    check(kind, make_inputs(kind, T=63, V=32, num_states=3), variant="scan_output",
          cu_seqlens=torch.tensor([0, 5, 40, 63]))


@pytest.mark.parametrize("tiles", ["bf16", "fp32"])
def test_scan_output_equals_output_kernel(tiles, chunk32_nan_buffers):
    """o from the scan is output_kernel's bit for bit when both run value blocks of 16 (the same product
    shapes): the scan rounds h and v_new to their buffers' dtypes as output_kernel reads them back and sums the
    same two products. At other output blocks only within fp32 rounding (1.5e-8 max abs here at 32): the
    interpreter's fp32 matmul, like the GPU's tiles, may sum in another order for another shape. GDN on bf16 and
    fp32 tiles, two value blocks per head, three packed sequences with initial states."""
    base = SCALAR_DECAY_DEFAULT if tiles == "bf16" else FP32_TILES
    base = replace(base, scan_value_block=16, output_value_block=16)
    x = make_inputs("gdn", T=63, V=32, num_states=3)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    kw = dict(initial_state_BHKV=x["h0"], cu_seqlens=torch.tensor([0, 5, 40, 63]))
    with torch.no_grad():
        expected, _ = kernels.gated_delta_rule(*args, **kw, variant=base)
        got, _ = kernels.gated_delta_rule(*args, **kw, variant=replace(base, scan_output=True))
    assert torch.isfinite(expected).all()
    assert torch.equal(got, expected)
