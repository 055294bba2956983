"""A linear layer whose frozen base weight stays stored: decoded for the forward's matmul and again for the
backward's input gradient, never saved decoded (the registry's stored_linear op does both).

Shape legend: O out width, I in width; x's leading dims pass through.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.dispatch import op
from runtime.formats.saved import redecodable
from runtime.formats.weight import StoredWeight
from runtime.ops.stored_matmul.torch_form import format_kwargs


def stored_linear(x: torch.Tensor, weight: StoredWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [.., I] @ decode(weight)^T [I, O] (+ bias), the weight decoded in x's dtype: the registry's stored_linear op
    (runtime/ops/stored_matmul/: decoded tiles in registers on the GPU; the torch form decodes again in backward)."""
    codes, scale = weight.operands()
    return op("stored_linear", x.device)(x, codes, scale, **format_kwargs(weight.format), bias_O=bias)


class StoredLinear(nn.Module):
    """nn.Linear's interface over a StoredWeight: `weight` is the holder (its tensors `weight.codes`, `weight.scale`),
    `bias` an ordinary Parameter (releases keep biases unquantized)."""

    def __init__(self, base: nn.Linear, fmt):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = StoredWeight(fmt, tuple(base.weight.shape), base.weight.dtype, base.weight.device)
        self.bias = base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stored_linear(x, self.weight, self.bias)

    def effective_weight(self) -> torch.Tensor:
        """The decoded weight for layers that hand it to a fused op (saved by it as a recipe: runtime/formats/saved.py)."""
        return decoded_for_op(self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def decoded_for_op(weight: StoredWeight, dtype: torch.dtype | None = None, view=lambda t: t) -> torch.Tensor:
    """weight decoded (in dtype, default its own) for an op that may save it: saved as a way to decode it again."""
    dtype = dtype or weight.dtype
    return redecodable(weight.decode(dtype, view), lambda: weight.decode(dtype, view))
