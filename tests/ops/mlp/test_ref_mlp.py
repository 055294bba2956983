"""Dense SwiGLU MLP: the torch form (runtime/ops/mlp/torch_form.py) vs the fp64 reference, forward and every
gradient, and the reference vs the plain formula.

Shape legend: T tokens, D model width, F MLP width.
"""
import pytest
import torch
import torch.nn.functional as F

from reference_ops import mlp as ref
from runtime.ops.mlp import torch_form as run
from runtime.tolerances import assert_close

D = 32


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_torch_form_swiglu_mlp_matches_reference(dtype):
    torch.manual_seed(5)
    inputs = {"x_TD": torch.randn(63, D), "w_gate_FD": torch.randn(24, D) * 0.3,
              "w_up_FD": torch.randn(24, D) * 0.3, "w_down_DF": torch.randn(D, 24) * 0.3}
    run_in = {n: t.to(dtype).requires_grad_() for n, t in inputs.items()}
    ref_in = {n: t.detach().double().requires_grad_() for n, t in run_in.items()}
    out_run, out_ref = run.swiglu_mlp(**run_in), ref.swiglu_mlp(**ref_in)
    assert_close(out_run, out_ref, "swiglu_mlp", dtype, "out")
    cot = torch.randn_like(out_ref)
    out_run.backward(cot.to(dtype))
    out_ref.backward(cot)
    for name in inputs:
        assert_close(run_in[name].grad, ref_in[name].grad, "swiglu_mlp", dtype, "grad", name)


def test_reference_swiglu_mlp_is_the_plain_formula():
    torch.manual_seed(6)
    x, wg, wu, wd = torch.randn(5, 8), torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6)
    expected = (F.silu(x.double() @ wg.double().T) * (x.double() @ wu.double().T)) @ wd.double().T
    assert torch.allclose(ref.swiglu_mlp(x, wg, wu, wd), expected)
