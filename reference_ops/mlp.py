"""fp64 reference for the dense SwiGLU MLP (the dense layers' FFN and the MoE shared expert).

Shape legend: T tokens, D model width, F MLP width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# By config `hidden_act` name (the experts read it too). Alignment adds the model's own function for an
# activation a package generated (onboard/recognize/model_references.py), so the candidate is compared with it.
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def swiglu_mlp(
    x_TD: torch.Tensor, w_gate_FD: torch.Tensor, w_up_FD: torch.Tensor, w_down_DF: torch.Tensor, activation: str = "silu"
) -> torch.Tensor:
    """Dense gated MLP (also the shared expert): down(act(gate(x)) * up(x)). Returns y_TD in fp64."""
    x_TD = x_TD.to(torch.float64)
    h_TF = ACTIVATIONS[activation](x_TD @ w_gate_FD.to(torch.float64).T) * (x_TD @ w_up_FD.to(torch.float64).T)
    return h_TF @ w_down_DF.to(torch.float64).T
