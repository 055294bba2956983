"""A linear layer with a LoRA pair, and the weight layers read when they hand it to a fused op.

LoraLinear keeps the base layer's own weight and bias Parameters (same objects, same names), so a
model loads the release before or after LoRA is applied and checkpoints keep the base names. Over a
StoredLinear (runtime/formats/linear.py) the weight is its StoredWeight holder, decoded per call.
Shape legend: O out width, I in width, r rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.formats.linear import StoredLinear, decoded_for_op, stored_linear
from runtime.formats.saved import redecodable
from runtime.formats.weight import StoredWeight


class LoraLinear(nn.Linear):
    """y = x W^T + b + scale * dropout(x) A^T B^T. The factors are fp32 parameters (the optimizer's
    masters); the LoRA GEMMs run in the activations' dtype with fp32 accumulation, the second one adding
    into the base output in its epilogue, so no activation makes an fp32 round trip."""

    def __init__(self, base: nn.Linear | StoredLinear, rank: int, scale: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.zeros(rank, self.in_features, dtype=torch.float32, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=torch.float32, device=device))
        self.lora_scale = scale
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.lora_merged = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, StoredWeight):
            out = stored_linear(x, self.weight, self.bias)
        else:
            out = F.linear(x, self.weight, self.bias)
        if self.lora_merged:
            return out
        # cast per call, which is once per step: a module runs once per forward (again only under recompute)
        A_rI, B_Or = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        xa = F.linear(self.dropout(x), A_rI)
        out_2d = torch.addmm(out.flatten(0, -2), xa.flatten(0, -2), B_Or.t(), alpha=self.lora_scale)
        return out_2d.view(out.shape)

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A, [O, I] in fp32."""
        return self.lora_scale * (self.lora_B @ self.lora_A)

    def effective_weight(self) -> torch.Tensor:
        """W + scale * B A in W's dtype, for layers that read the weight instead of calling the module.
        Dropout acts on the layer's input, which such a reader never hands over: refused while training."""
        if self.lora_merged:
            return self.weight
        if self.training and isinstance(self.dropout, nn.Dropout):
            raise ValueError("LoRA dropout is not available on a projection its layer reads as a weight (fused op)")
        if isinstance(self.weight, StoredWeight):
            # an op saving W + delta keeps how to rebuild it (decode again, same factors), not the tensor
            dtype = self.weight.dtype
            rebuild = lambda: self.weight.decode(dtype) + self.delta_weight().to(dtype)  # noqa: E731
            return redecodable(rebuild(), rebuild)
        return self.weight + self.delta_weight().to(self.weight.dtype)


def weight_of(linear: nn.Linear) -> torch.Tensor:
    """The weight a layer multiplies by when it passes it to an op rather than calling the module.
    With LoRA this materializes W + scale * B A (and autograd then forms the [O, I] weight gradient
    to reach A and B): correct, at the cost of one dense weight gradient for that projection.
    A stored base weight is decoded here, in the dtype the model was cast to."""
    if isinstance(linear, LoraLinear):
        return linear.effective_weight()
    return decoded_for_op(linear.weight) if isinstance(linear, StoredLinear) else linear.weight
