"""The dense SwiGLU MLP / shared expert kernel (runtime/ops/mlp/kernel.py) under TRITON_INTERPRET=1
vs the fp64 reference: with and without the sigmoid gate and the residual it adds into, leading
batch dims, padded stacked rows; forward and every gradient, NaN-prefilled buffers.

Shape legend: T tokens, D model width, F MLP width. fp32 inputs (bf16 tl.dot is wrong under the interpreter).
"""
import pytest
import torch

from reference_ops import mlp as ref
from runtime.ops.mlp import kernel as kernels
from runtime.tolerances import assert_close

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("nan_buffers")]

D = 32


MLP_CASES = {
    # leading batch dims, F 24 masks the last column block, 2F 48 needs no padding rows
    "dense-B2-T19-F24": dict(lead=(2, 19), F=24, gated=False, residual=False),
    # 2F + 1 = 41 stacked rows padded to 48, the routed output added in place
    "shared-gated-residual-T63-F20": dict(lead=(63,), F=20, gated=True, residual=True),
    "shared-gated-T63-F20": dict(lead=(63,), F=20, gated=True, residual=False),
    "shared-residual-T63-F40": dict(lead=(63,), F=40, gated=False, residual=True),
}


def _mlp_reference(leaves: dict) -> torch.Tensor:
    out = ref.swiglu_mlp(leaves["x"], leaves["w_gate"], leaves["w_up"], leaves["w_down"])
    if "gate" in leaves:
        out = out * torch.sigmoid(leaves["x"] @ leaves["gate"].T)
    return out + leaves["residual"] if "residual" in leaves else out


@pytest.mark.parametrize("case", list(MLP_CASES))
def test_swiglu_mlp_matches_reference(case):
    c = MLP_CASES[case]
    torch.manual_seed(13)
    leaves = {"x": torch.randn(*c["lead"], D), "w_gate": torch.randn(c["F"], D) * D ** -0.5,
              "w_up": torch.randn(c["F"], D) * D ** -0.5, "w_down": torch.randn(D, c["F"]) * c["F"] ** -0.5}
    if c["gated"]:
        leaves["gate"] = torch.randn(1, D) * D ** -0.5
    if c["residual"]:
        leaves["residual"] = torch.randn(*c["lead"], D)
    run_in = {n: t.detach().requires_grad_() for n, t in leaves.items()}
    ref_in = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    # the kernel writes the residual in place: hand it a non-leaf, as the MoE block does
    residual = run_in["residual"].clone() if c["residual"] else None
    out = kernels.swiglu_mlp(run_in["x"], run_in["w_gate"], run_in["w_up"], run_in["w_down"],
                             gate_1D=run_in.get("gate"), residual_TD=residual)
    expected = _mlp_reference(ref_in)
    assert_close(out, expected, "swiglu_mlp", torch.float32, "out")
    cot = torch.randn_like(expected)
    out.backward(cot.float())
    expected.backward(cot)
    for name in leaves:
        assert_close(run_in[name].grad, ref_in[name].grad, "swiglu_mlp", torch.float32, "grad", name)


def test_swiglu_mlp_other_activations_use_torch():
    torch.manual_seed(14)
    x, wg, wu, wd = torch.randn(9, D), torch.randn(8, D), torch.randn(8, D), torch.randn(D, 8)
    out = kernels.swiglu_mlp(x, wg, wu, wd, "gelu")
    assert_close(out, ref.swiglu_mlp(x.double(), wg, wu, wd, "gelu"), "swiglu_mlp", torch.float32, "out")
