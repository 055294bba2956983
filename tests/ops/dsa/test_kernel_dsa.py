"""DSA Triton kernels under TRITON_INTERPRET=1 vs the fp64 reference: sparse attention forward,
dq, dkv (idx with -1 slots, NaN-prefilled outputs, several head blocks per token, dq and dkv column blocks
of partial width) and the fused indexer top-k.

Shape legend: B batch, T tokens, H heads, K = V + R key width, V value width, S selected keys.
fp32 inputs: under the interpreter a tl.dot on bf16 operands is wrong in triton 3.9.
"""
import pytest
import torch

from reference_ops import dsa as ref
from runtime.ops.dsa import kernel as kernels
from runtime.ops.dsa import attention, indexer
from runtime.tolerances import assert_close
from tests.ops.dsa.dsa_problems import assert_same_selection, random_sparse_problem, with_dropped_slots

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("nan_buffers")]


def assert_matches_reference(B, T, H, V, R, S, drop, seed):
    """o, dq and dkv of the kernels against the fp64 reference; `seed` picks the dropped slots, seed + 1 dO."""
    q_BTHK, kv_BTK, idx_BTS = random_sparse_problem(B, T, H, V + R, S, torch.float32)
    idx_BTS = with_dropped_slots(idx_BTS, drop, seed=seed)
    do_BTHV = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(seed + 1))
    scale = (V + R) ** -0.5
    results = {}
    for name, fn, dtype in (("ref", ref.sparse_attention, torch.float64), ("kernel", kernels.sparse_attention, torch.float32)):
        q, kv = q_BTHK.to(dtype).requires_grad_(), kv_BTK.to(dtype).requires_grad_()
        o_BTHV = fn(q, kv, idx_BTS, scale, V)
        o_BTHV.backward(do_BTHV.to(dtype))
        results[name] = (o_BTHV, q.grad, kv.grad)
    for label, actual, expected in zip(("o", "dq", "dkv"), results["kernel"], results["ref"]):
        assert_close(actual, expected, "dsa_attention", torch.float32, "out" if label == "o" else "grad", label)


ATTENTION_CASES = [
    pytest.param(1, 37, 4, 32, 16, 8, 0.0, id="T37-H4-V32R16-S8"),
    pytest.param(1, 37, 4, 32, 16, 8, 0.3, id="T37-H4-S8-dropped-slots"),
    pytest.param(2, 21, 3, 20, 12, 37, 0.2, id="B2-T21-H3-V20R12-S37-padded-widths"),
]


@pytest.mark.parametrize("B,T,H,V,R,S,drop", ATTENTION_CASES)
def test_sparse_attention_forward_and_grads(B, T, H, V, R, S, drop):
    assert_matches_reference(B, T, H, V, R, S, drop, seed=1)


def test_several_head_blocks_per_token_match_reference(monkeypatch):
    """3 heads in blocks of 2 (the second padded), so a token's programs are neighbours on the 1-D
    grid as at 128 heads; smaller key steps, so that a row's keys take several; the backward in chunks."""
    monkeypatch.setattr(attention, "FWD_HEADS", 2)
    monkeypatch.setattr(attention, "SCORE_HEADS", 2)
    monkeypatch.setattr(attention, "FWD_KEYS", 4)
    monkeypatch.setattr(attention, "SCORE_KEYS", 4)
    # the dq and dkv passes in blocks of 2 heads and 4 slots, and the backward in chunks of 7 tokens, which cross
    # the batch boundary (T 19) and leave a short last chunk
    monkeypatch.setattr(attention, "DQ_HEADS", 2)
    monkeypatch.setattr(attention, "DQ_KEYS", 4)
    monkeypatch.setattr(attention, "DKV_HEADS", 2)
    monkeypatch.setattr(attention, "DKV_KEYS", 4)
    monkeypatch.setattr(attention, "BWD_CHUNK_TOKENS", 7)
    # guards the test: the kernels really see two head blocks per token
    assert attention._tiles(3, 32, 16, attention.SCORE_HEADS, attention.SCORE_KEYS)["BH"] == 2
    assert attention._column_tiles(3, 8, 16, attention.DQ_HEADS, attention.DQ_KEYS, attention.DQ_COLUMNS)["BH"] == 2
    assert_matches_reference(2, 19, 3, 32, 16, 8, drop=0.2, seed=4)


def test_dq_and_dkv_column_blocks_match_reference(monkeypatch):
    """The dq and dkv passes in 16-column blocks: V 40 takes three value blocks and R 24 two rope blocks, the last
    of each 8 wide; 16 slots a step or program, so 21 slots take two blocks, the second 5 wide; 2 heads of 3 a
    program (dq) or step (dkv); chunks of 7 tokens crossing the batch boundary (T 30); dropped slots on top of the
    causal -1 padding. Then R 12: one rope block of 16 columns, narrower than the 32-column value blocks."""
    for name, value in (("HEADS", 2), ("KEYS", 16), ("COLUMNS", 16)):
        monkeypatch.setattr(attention, "DQ_" + name, value)
        monkeypatch.setattr(attention, "DKV_" + name, value)
    monkeypatch.setattr(attention, "BWD_CHUNK_TOKENS", 7)
    # guards the test: the column kernels really see these tiles
    for prefix in ("DQ_", "DKV_"):
        tiles = attention._column_tiles(3, 21, 24, *(getattr(attention, prefix + n) for n in ("HEADS", "KEYS", "COLUMNS")))
        assert tiles == dict(BH=2, BS=16, BC=16, BCR=16)
    assert_matches_reference(2, 30, 3, 40, 24, 21, drop=0.2, seed=6)
    monkeypatch.setattr(attention, "DQ_COLUMNS", 32)
    monkeypatch.setattr(attention, "DKV_COLUMNS", 32)
    assert attention._column_tiles(3, 21, 12, 2, 16, 32) == dict(BH=2, BS=16, BC=32, BCR=16)
    assert_matches_reference(2, 30, 3, 40, 12, 21, drop=0.2, seed=7)


def test_sparse_attention_query_without_keys_gives_zeros():
    q_BTHK, kv_BTK, idx_BTS = random_sparse_problem(1, 9, 2, 48, 8, torch.float32)
    idx_BTS[0, 4] = -1
    q, kv = q_BTHK.requires_grad_(), kv_BTK.requires_grad_()
    o_BTHV = kernels.sparse_attention(q, kv, idx_BTS, 0.2, 32)
    o_BTHV.sum().backward()
    assert torch.equal(o_BTHV[0, 4], torch.zeros(2, 32))
    assert torch.equal(q.grad[0, 4], torch.zeros(2, 48))
    assert torch.isfinite(kv.grad).all()


@pytest.fixture
def small_indexer_tiles(monkeypatch):
    """16 x 16 score tiles: several query and key tiles per block at these T (and a faster interpreter)."""
    monkeypatch.setattr(indexer, "BLOCK_Q", 16)
    monkeypatch.setattr(indexer, "BLOCK_T", 16)


@pytest.mark.parametrize("B,T,H,K,topk,block_size", [
    pytest.param(1, 37, 4, 32, 8, 16, id="T37-H4-K32-top8-blk16"),
    pytest.param(2, 63, 3, 24, 20, 64, id="B2-T63-H3-K24-top20-one-block"),
    pytest.param(1, 21, 2, 16, 50, 8, id="T21-top50-all-keys"),
])
def test_indexer_topk_selects_the_reference_set(B, T, H, K, topk, block_size, small_indexer_tiles):
    g = torch.Generator().manual_seed(4)
    q_BTHK, k_BTK, w_BTH = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, K, generator=g), torch.randn(B, T, H, generator=g)
    scores_BTT = ref.indexer_scores(q_BTHK, k_BTK, w_BTH, K**-0.5)
    actual_BTS = kernels.indexer_topk(q_BTHK, k_BTK, w_BTH, K**-0.5, topk, block_size=block_size)
    assert_same_selection(actual_BTS, ref.topk_indices(scores_BTT, topk), scores_BTT)


def test_indexer_block_scores_match_reference_scores(small_indexer_tiles):
    g = torch.Generator().manual_seed(5)
    q_BTHK, k_BTK, w_BTH = torch.randn(1, 37, 3, 24, generator=g), torch.randn(1, 37, 24, generator=g), torch.rand(1, 37, 3, generator=g)
    expected_BQT = ref.indexer_scores(q_BTHK, k_BTK, w_BTH, 0.3)[:, 13:29, :29]
    actual_BQT = indexer.block_scores(q_BTHK, k_BTK, w_BTH, 0.3, 13, 29)
    future_BQT = torch.isinf(expected_BQT)
    assert torch.equal(torch.isinf(actual_BQT) & (actual_BQT < 0), future_BQT)
    assert_close(actual_BQT.masked_fill(future_BQT, 0), expected_BQT.masked_fill(future_BQT, 0), "indexer_scores", torch.float32)
