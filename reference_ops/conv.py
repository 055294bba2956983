"""Reference short causal depthwise convolution in fp64 (the q/k/v conv of GDN/KDA layers).

Shape legend: B batch, T tokens, C channels, W kernel width, X = T + W - 1 padded tokens.
"""

from __future__ import annotations

import torch


def causal_conv1d(
    x_BTC: torch.Tensor, weight_CW: torch.Tensor, bias_C: torch.Tensor | None = None, activation: str | None = "silu"
) -> torch.Tensor:
    """y[b, t, c] = act(bias[c] + sum_w weight[c, w] * x[b, t - (W-1) + w, c]), x before t=0 taken as 0."""
    x_BTC, weight_CW = x_BTC.double(), weight_CW.double()
    num_tokens, width = x_BTC.shape[1], weight_CW.shape[1]
    x_padded_BXC = torch.cat([x_BTC.new_zeros(x_BTC.shape[0], width - 1, x_BTC.shape[2]), x_BTC], dim=1)
    y_BTC = torch.zeros_like(x_BTC) if bias_C is None else bias_C.double().expand_as(x_BTC)
    for w in range(width):
        # tap w reads the token W-1-w steps back: padded index t + w
        y_BTC = y_BTC + weight_CW[:, w] * x_padded_BXC[:, w : w + num_tokens]
    if activation in ("silu", "swish"):
        return y_BTC * torch.sigmoid(y_BTC)
    if activation is None:
        return y_BTC
    raise ValueError(f"causal_conv1d: activation {activation!r} is not silu, swish or None")
