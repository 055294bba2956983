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

# Gated activations with parameters of their own, by `hidden_act` name: they act on gate and up together, so they
# are not in ACTIVATIONS (one function of the gate); their parameters travel with the spec (runtime/spec.py).
SITU = "situ"


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """Kimi K3's SiTU-GLU: beta tanh(gate / beta) sigmoid(gate) times the up projection soft-capped at linear_beta,
    linear_beta tanh(up / linear_beta) (not capped when linear_beta is None)."""
    activated = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return activated * up


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str,
          situ_betas: tuple[float, float | None] | None = None) -> torch.Tensor:
    """act(gate) * up for an ACTIVATIONS name; SiTU-GLU with its (beta, linear_beta) for "situ"."""
    if activation == SITU:
        if situ_betas is None:
            raise ValueError("the situ activation needs its (beta, linear_beta)")
        return situ_glu(gate, up, *situ_betas)
    return ACTIVATIONS[activation](gate) * up


def swiglu_mlp(
    x_TD: torch.Tensor, w_gate_FD: torch.Tensor, w_up_FD: torch.Tensor, w_down_DF: torch.Tensor, activation: str = "silu",
    *, situ_betas: tuple[float, float | None] | None = None,
) -> torch.Tensor:
    """Dense gated MLP (also the shared expert): down(act(gate(x)) * up(x)), or down(situ_glu(gate(x), up(x))) for
    activation "situ" with situ_betas = (beta, linear_beta). Returns y_TD in fp64."""
    x_TD = x_TD.to(torch.float64)
    h_TF = gated(x_TD @ w_gate_FD.to(torch.float64).T, x_TD @ w_up_FD.to(torch.float64).T, activation, situ_betas)
    return h_TF @ w_down_DF.to(torch.float64).T
