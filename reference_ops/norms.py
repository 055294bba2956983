"""Reference norms in fp64: the truth the runtime forms are tested against.

Shape legend: ... any leading dims, D normalized width.
Inputs are promoted to fp64 (differentiably), so gradients reach leaves of any dtype.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """y[..., D] = x / sqrt(mean(x^2) + eps) * (offset + weight[D]); offset 1.0 is the "1+w" form."""
    x = x.double()
    inv_rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x * inv_rms * (offset + weight.double())


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str = "silu") -> torch.Tensor:
    """y[..., D] = rms_norm(x) * weight[D] * act(gate[..., D]): silu for Qwen3-Next's output norm,
    sigmoid for Kimi's KDA output norm."""
    gate = gate.double()
    gated = torch.sigmoid(gate) if activation == "sigmoid" else gate * torch.sigmoid(gate)
    return rms_norm(x, weight, eps) * gated


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y[..., D] = (x - mean) / sqrt(var + eps) * weight[D] + bias[D]; biased variance, as nn.LayerNorm."""
    x = x.double()
    centered = x - x.mean(dim=-1, keepdim=True)
    y = centered * torch.rsqrt(centered.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y
