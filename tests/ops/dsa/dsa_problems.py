"""Shared DSA test inputs and the selection check, for tests/ops/dsa/test_ref_dsa.py and
tests/ops/dsa/test_kernel_dsa.py.

Shape legend: B batch, T tokens, H heads, K key width, S selected keys.
"""
from __future__ import annotations

import torch

from reference_ops import dsa as ref


def random_sparse_problem(B, T, H, K, S, dtype, seed=0):
    """q, kv and causal random indices (distinct per row, -1 beyond the causal range)."""
    g = torch.Generator().manual_seed(seed)
    q_BTHK = torch.randn(B, T, H, K, generator=g).to(dtype)
    kv_BTK = torch.randn(B, T, K, generator=g).to(dtype)
    scores_BTT = torch.rand(B, T, T, generator=g).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    idx_BTS = ref.topk_indices(scores_BTT, S)
    return q_BTHK, kv_BTK, idx_BTS


def with_dropped_slots(idx_BTS, fraction, seed):
    """Sets a random `fraction` of the index slots to -1 (on top of the causal padding)."""
    g = torch.Generator().manual_seed(seed)
    return idx_BTS.masked_fill(torch.rand(idx_BTS.shape, generator=g) < fraction, -1)


def assert_same_selection(actual_BTS, expected_BTS, scores_BTT):
    """Top-k sets may differ only among keys of equal score (relu makes exact ties at zero):
    same number of valid keys per query, no repeats, and the same multiset of scores."""
    assert actual_BTS.shape == expected_BTS.shape
    assert torch.equal((actual_BTS >= 0).sum(-1), (expected_BTS >= 0).sum(-1))
    sorted_BTS = actual_BTS.sort(-1).values
    repeated_BTS = (sorted_BTS[..., 1:] == sorted_BTS[..., :-1]) & (sorted_BTS[..., 1:] >= 0)
    assert not repeated_BTS.any()

    def picked_scores(idx_BTS):
        picked_BTS = scores_BTT.double().gather(-1, idx_BTS.clamp(min=0).long())
        return picked_BTS.masked_fill(idx_BTS < 0, float("-inf")).sort(-1).values

    torch.testing.assert_close(picked_scores(actual_BTS), picked_scores(expected_BTS), rtol=1e-5, atol=1e-6)
