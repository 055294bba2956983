"""The GDN/KDA backward kernels over several key blocks (function.KEY_BLOCK 8 and STATE_GRAD_KEY_BLOCK 4 at
K=16: wy_grad_kernel in two key blocks, state_grad_kernel in four), so the per-key-block partials are summed
as at the benchmark shape (K=128 in blocks of 64 and 32); the interpreter, NaN-filled buffers and chunk 32 as
in test_kernel_gated_delta.py.
"""
import pytest
import torch

from runtime.ops.gated_delta import function
from tests.ops.gated_delta.gated_delta_cases import CU_SEQLENS, check, check_case, make_inputs

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("small_chunks_nan_buffers")]
KINDS = ["gdn", "kda"]


@pytest.fixture(autouse=True)
def several_key_blocks(monkeypatch):
    monkeypatch.setattr(function, "KEY_BLOCK", 8)
    monkeypatch.setattr(function, "STATE_GRAD_KEY_BLOCK", 4)


@pytest.mark.parametrize("case", ["cu_seqlens", "batch2-no-l2norm-strong-decay"])
@pytest.mark.parametrize("kind", KINDS)
def test_backward_key_blocks(kind, case):
    check_case(kind, case)


def test_backward_key_blocks_bf16_gdn():
    """bf16 inputs: wy_grad's bf16 products, dL's Gram backward on the raw k per key block."""
    check("gdn", make_inputs("gdn", num_states=3), dtype=torch.bfloat16, cu_seqlens=torch.tensor(CU_SEQLENS))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_backward_benchmark_chunk_size(kind, monkeypatch):
    """The benchmark's chunk of 64 (four sub-chunks of 16) over two sequences, K=32 in key blocks of 16 (state_grad
    in blocks of 8)."""
    monkeypatch.setattr(function, "CHUNK_SIZE", 64)
    monkeypatch.setattr(function, "KEY_BLOCK", 16)
    monkeypatch.setattr(function, "STATE_GRAD_KEY_BLOCK", 8)
    x = make_inputs(kind, T=150, K=32, V=32, num_states=2)
    check(kind, x, cu_seqlens=torch.tensor([0, 70, 150]))
