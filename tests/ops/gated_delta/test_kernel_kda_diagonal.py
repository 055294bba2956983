"""KDA's per-channel kernels beyond the shapes of test_kernel_gated_delta.py: the token-parallel diagonal
kernels (diagonal.diag_token_kernel, diag_grad_token_kernel, dg_finish_kernel) at H=3 (one head per program)
and backward.gram_grad_kernel walking several earlier and later sub-chunks, against the fp64 reference under
the interpreter with NaN-filled buffers, chunk 32.
"""
import pytest
import torch

from runtime.ops.gated_delta import function
from tests.ops.gated_delta.gated_delta_cases import CU_SEQLENS, check, make_inputs

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("small_chunks_nan_buffers")]


def test_kda_cu_seqlens_three_heads():
    """Three packed sequences, one state each; H=3: the diagonal kernels' 8 and 4 heads a program fall to one."""
    check("kda", make_inputs("kda", H=3, num_states=3), cu_seqlens=torch.tensor(CU_SEQLENS))


def test_kda_gram_grad_four_sub_chunks(monkeypatch):
    """gram_grad_kernel's loops over several earlier and later sub-chunks: chunk 32 in sub-chunks of 8 (the
    interpreter's products take any size), three packed sequences, the last chunk of one ending mid-sub-chunk."""
    monkeypatch.setattr(function, "SUB_CHUNK", 8)
    x = make_inputs("kda", T=50, num_states=3)
    check("kda", x, cu_seqlens=torch.tensor([0, 3, 45, 50]))


@pytest.mark.slow
def test_kda_benchmark_chunk_size(monkeypatch):
    """The benchmark's chunk 64 (four sub-chunks), two packed sequences."""
    monkeypatch.setattr(function, "CHUNK_SIZE", 64)
    x = make_inputs("kda", T=150, num_states=2)
    check("kda", x, cu_seqlens=torch.tensor([0, 70, 150]))
