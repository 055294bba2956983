"""The routed experts' grouped GEMMs over stored base weights (tiles decoded in registers) under TRITON_INTERPRET=1
vs the fp64 twin: forward and the gradients of x (both weights read transposed), the routing weights, the biases and
the LoRA factors, every kernel buffer NaN-filled: FP8 with partial 32- and 128-blocks and UE8M0 scales, MXFP4 with the
gpt-oss GLU, an expert with no tokens, T=63, and row tiles of 16 that cut experts into several. The tile decoders also
compile for sm_90a on this machine (the interpreter accepts what the compiler does not, a plain global in a jit
function for one).

fp32 inputs: under the interpreter a tl.dot on bf16 operands is wrong.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

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


REPO = Path(__file__).resolve().parents[3]
# the grouped GEMM reading an MXFP4 weight transposed (dx), and an FP8 one with UE8M0 bytes gathered per element
COMPILE = """
import json
from bench.kernel_resources import resources
from runtime.ops.moe.grouped_gemm import grouped_gemm_kernel
sig = {"pair_ptr": "*i64", "tile_expert_ptr": "*i32", "tile_start_ptr": "*i32", "ends_ptr": "*i32",
       "lora_scale": "fp32", "limit": "fp32", "alpha": "fp32", "situ_beta": "fp32",
       "situ_linear_beta": "fp32", "scale_ptr": "*fp32"}
used = []
for fmt, codes, trans in ((2, "*u8", True), (1, "*fp8e4nv", False)):
    flags = dict(TOP_K=4, MODE=0, GATHER_A=True, SCATTER_C=True, ROW_SCALE=True, HAS_BIAS=False, HAS_LORA=True,
                 CLAMP=False, HAS_ALPHA=False, SITU=False, CAP_UP=False, PRECISION="tf32", EVEN_K=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                 BLOCK_R=16, FORMAT=fmt, TRANS_W=trans, SCALE_E8M0=True, SCALE_MODE=0)
    used.append(resources(grouped_gemm_kernel, sig | {"w_ptr": codes, "ws_ptr": "*u8"}, flags, num_warps=8,
                          num_stages=3))
print(json.dumps(used))
"""


def test_stored_tiles_compile_for_sm90a():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO)]))
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for used in json.loads(done.stdout.strip().splitlines()[-1]):
        assert 0 < used["registers"] <= 255 and used["shared_bytes"] > 0, used
