"""The routed experts' grouped GEMMs over stored base weights (tiles decoded in registers) under TRITON_INTERPRET=1
vs the fp64 twin: forward and the gradients of x (both weights read transposed), the routing weights, the biases and
the LoRA factors, every kernel buffer NaN-filled: FP8 with partial 32- and 128-blocks and UE8M0 scales, MXFP4 with the
gpt-oss GLU, an expert with no tokens, T=63, and row tiles of 16 that cut experts into several.

fp32 inputs: under the interpreter a tl.dot on bf16 operands is wrong.
"""
import pytest
import torch

from runtime.ops.moe import experts, kernel
from runtime.ops.moe import torch_form as torch_ops
from tests.ops.moe.test_ref_moe_stored import CASES, check_stored_experts
from tests.ops.stored_matmul.problems import stored_weight

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("nan_buffers")]


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case):
    E, k, D, F, kind, block, options = CASES[case]
    check_stored_experts(kernel.stored_swiglu_experts, E, k, D, F, kind, block, **options)


def test_kernel_over_several_row_tiles_each(monkeypatch):
    monkeypatch.setattr(experts, "BLOCK_M", 16)
    check_stored_experts(kernel.stored_swiglu_experts, 4, 2, 64, 32, "mxfp4", None, lora_rank=2)


def test_unfused_activation_runs_the_torch_form():
    """A package's generated activation reaches the kernel entry point on CUDA: it computes through the torch form."""
    gate_up, down = stored_weight((3, 64, 32), "mxfp4"), stored_weight((3, 32, 32), "mxfp4", seed=1)
    x, idx, w = torch.randn(9, 32), torch.randint(0, 3, (9, 1)), torch.rand(9, 1)
    ours = kernel.stored_swiglu_experts(x, w, idx, *gate_up, *down, kind="mxfp4", activation="gelu")
    theirs = torch_ops.stored_swiglu_experts(x, w, idx, *gate_up, *down, kind="mxfp4", activation="gelu")
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
