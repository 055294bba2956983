"""The stored-weight matmul's Triton kernel (the grouped GEMM as one group, decoding tiles in registers) under
TRITON_INTERPRET=1 vs the fp64 twin: forward and the gradients of x (the weight read transposed), the bias and the
LoRA factors, every kernel buffer NaN-filled. FP8: 576- and 192-row weights with 128-blocks (partial last blocks),
blocks that do not hold the kernel's 32-long reduction chunk (scales gathered per element), UE8M0 scales; MXFP4:
packed rows and gpt-oss's blocks; T=63.

fp32 inputs: under the interpreter a tl.dot on bf16 operands is wrong.
"""
import pytest
import torch

from runtime.ops.stored_matmul import kernel
from tests.ops.stored_matmul.test_ref_stored_matmul import CASES, check_stored_linear

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("nan_buffers")]

KERNEL_CASES = CASES | {
    # 48-row and 80-column blocks hold no 32-long chunk of either reduction: per-element scales both ways
    "fp8-100x112-block48x80-per-element-scales": (100, 112, "fp8_block", (48, 80), {}),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_matches_reference(case):
    O, I, kind, block, options = KERNEL_CASES[case]
    check_stored_linear(kernel.stored_linear, O, I, kind, block, **options)


def test_kernel_without_bias_or_lora_over_several_row_tiles(monkeypatch):
    monkeypatch.setattr(kernel, "BLOCK_M", 16)
    check_stored_linear(kernel.stored_linear, 64, 64, "mxfp4", None, lora_rank=0, bias=False)


def test_selector_picks_the_torch_form_off_cuda():
    from runtime import dispatch
    from runtime.ops.stored_matmul import torch_form

    assert dispatch.op("stored_linear", torch.device("cpu")) is torch_form.stored_linear
