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


ACTIVATION_CASES = {
    "silu": {},
    # Kimi K3's SiTU-GLU at its released betas, and at caps the pre-activations here (std ~1.7) saturate
    "situ-k3-betas": dict(activation="situ", situ_betas=(4.0, 25.0)),
    "situ-saturating": dict(activation="situ", situ_betas=(1.0, 0.5)),
}


@pytest.mark.parametrize("case", list(ACTIVATION_CASES))
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_torch_form_swiglu_mlp_matches_reference(dtype, case):
    torch.manual_seed(5)
    inputs = {"x_TD": torch.randn(63, D), "w_gate_FD": torch.randn(24, D) * 0.3,
              "w_up_FD": torch.randn(24, D) * 0.3, "w_down_DF": torch.randn(D, 24) * 0.3}
    run_in = {n: t.to(dtype).requires_grad_() for n, t in inputs.items()}
    ref_in = {n: t.detach().double().requires_grad_() for n, t in run_in.items()}
    static = ACTIVATION_CASES[case]
    out_run, out_ref = run.swiglu_mlp(**run_in, **static), ref.swiglu_mlp(**ref_in, **static)
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


def test_situ_glu_is_the_k3_formula():
    """SiTU-GLU as Kimi K3's modeling code states it: beta tanh(g / beta) sigmoid(g) * lb tanh(u / lb); at large
    betas it tends to SwiGLU, and the caps bound it: |h| <= beta * lb."""
    torch.manual_seed(7)
    g, u = torch.randn(9, 5, dtype=torch.float64) * 6, torch.randn(9, 5, dtype=torch.float64) * 40
    expected = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))
    assert torch.allclose(ref.situ_glu(g, u, 4.0, 25.0), expected)
    assert torch.allclose(ref.gated(g, u, "situ", (4.0, None)), 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * u)
    assert torch.allclose(ref.situ_glu(g, u, 1e6, 1e6), F.silu(g) * u)
    assert ref.situ_glu(g, u, 4.0, 25.0).abs().max() <= 100.0
    with pytest.raises(ValueError, match="beta"):
        ref.gated(g, u, "situ")
