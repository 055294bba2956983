"""The unit lower inverse (I + L)^-1 of prep_blocked_kernel under TRITON_INTERPRET=1: doubling on the diagonal
blocks and level-by-level merging at the real chunk size, against an fp64 solve, on keys drawn at random and on
keys that repeat (where the doubling's partial products cancel); the op-level tests (test_kernel_gated_delta.py)
run it mostly at chunk 32.

Shape legend: C chunk size, S sub-chunk size, K key dim.
"""
import pytest
import torch
import triton
import triton.language as tl

from runtime.ops.gated_delta.common import (
    block_diagonal, diag_block_inverse, merge_block_inverse,
)

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
