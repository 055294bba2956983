"""Norms in the runtime: computed in fp32 and cast back to the input dtype, as transformers does.

Shape legend: ... any leading dims, D normalized width.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# Norms a package generated, by the spec's norm `kind`: op(x_TD, weight_D) -> y_TD (runtime/package_ops.py adds
# them when the package loads; the built-in kinds are rms_norm's)
NORMS: dict[str, Callable] = {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """y[..., D] = x / rms(x) * (offset + weight[D]), in fp32, returned in x.dtype."""
    scale_D = weight.float() + offset if offset else weight.float()
    return F.rms_norm(x.float(), (x.shape[-1],), scale_D, eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str = "silu") -> torch.Tensor:
    """y[..., D] = rms_norm(x) * weight[D] * act(gate[..., D]), act silu (Qwen3-Next) or sigmoid (Kimi KDA);
    in fp32, returned in x.dtype."""
    y = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    gate = gate.float()
    return (y * (torch.sigmoid(gate) if activation == "sigmoid" else F.silu(gate))).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y[..., D] = layer_norm(x) * weight[D] + bias[D], in fp32, returned in x.dtype."""
    weight = None if weight is None else weight.float()
    bias = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (x.shape[-1],), weight, bias, eps).to(x.dtype)
