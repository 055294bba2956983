"""Torch form of the dense SwiGLU MLP and the MoE shared expert (its sigmoid gate and the
add into the routed experts' output). Runs everywhere, any dtype.

Shape legend: T tokens (all leading dims of x), D model width, F MLP width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# By config `hidden_act` name (the experts read it too); a package's generated activations are added when
# it loads (runtime/package_ops.py), so the registry's predicates see them.
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

# Gated activations with parameters of their own act on gate and up together, so they are not in ACTIVATIONS
# (one function of the gate): Kimi K3's SiTU-GLU, its (beta, linear_beta) carried by the spec (runtime/spec.py).
SITU = "situ"


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """beta tanh(gate / beta) sigmoid(gate) * linear_beta tanh(up / linear_beta) (up as is when linear_beta is None)."""
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
    x_TD: torch.Tensor,
    w_gate_FD: torch.Tensor,
    w_up_FD: torch.Tensor,
    w_down_DF: torch.Tensor,
    activation: str = "silu",
    *,
    gate_1D: torch.Tensor | None = None,
    residual_TD: torch.Tensor | None = None,
    situ_betas: tuple[float, float | None] | None = None,
) -> torch.Tensor:
    """Dense gated MLP (also the shared expert): down(act(gate(x)) * up(x)) (SiTU-GLU for activation "situ", with
    situ_betas); with the shared-expert gate gate_1D [1, D] times sigmoid(x @ gate_1D^T), plus residual_TD (the
    routed experts' output)."""
    out_TD = F.linear(gated(F.linear(x_TD, w_gate_FD), F.linear(x_TD, w_up_FD), activation, situ_betas), w_down_DF)
    if gate_1D is not None:
        out_TD = out_TD * torch.sigmoid(F.linear(x_TD, gate_1D))
    return out_TD if residual_TD is None else residual_TD + out_TD
