"""Short causal depthwise convolution in the runtime (torch conv1d, fp32 compute, cast back).

Shape legend: B batch, T tokens, C channels, W kernel width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x_BTC: torch.Tensor, weight_CW: torch.Tensor, bias_C: torch.Tensor | None = None, activation: str | None = "silu"
) -> torch.Tensor:
    """y_BTC in x's dtype: depthwise conv over time, left-padded by W-1, then silu (or no activation)."""
    if activation not in ("silu", "swish", None):
        raise ValueError(f"causal_conv1d: activation {activation!r} is not silu, swish or None")
    num_tokens, num_channels, width = x_BTC.shape[1], x_BTC.shape[2], weight_CW.shape[1]
    bias_C = None if bias_C is None else bias_C.float()
    # conv1d pads both sides; keeping the first T outputs makes it causal
    y_BCT = F.conv1d(
        x_BTC.float().transpose(1, 2), weight_CW.float().unsqueeze(1), bias_C, padding=width - 1, groups=num_channels
    )
    y_BTC = y_BCT[..., :num_tokens].transpose(1, 2)
    if activation is not None:
        y_BTC = F.silu(y_BTC)
    return y_BTC.to(x_BTC.dtype)
