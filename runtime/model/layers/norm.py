"""RMSNorm module (plain or (1 + w)) over the registry's rms_norm op; `.weight` as releases name it."""
from __future__ import annotations

import torch
from torch import nn

from runtime.spec import NormSpec
from runtime.dispatch import op
from runtime.ops.norm.torch_form import NORMS


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float, offset: float = 0.0):
        super().__init__()
        # (1 + w) releases store w around 0; plain ones around 1
        self.weight = nn.Parameter(torch.full((width,), 1.0 - offset))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return op("rms_norm", x.device)(x, self.weight, self.eps, self.offset)


class GeneratedNorm(nn.Module):
    """A norm kind a package generated: NORMS[kind](x, weight), its eps and weight offset inside the op."""

    def __init__(self, width: int, kind: str):
        super().__init__()
        if kind not in NORMS:
            raise KeyError(f"norm kind {kind!r}: not built in (rms, rms_1p) and no generated op of that name is "
                           f"registered (runtime/package_ops.py); generated: {sorted(NORMS)}")
        self.weight = nn.Parameter(torch.ones(width))
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NORMS[self.kind](x, self.weight)


def make_norm(width: int, norm: NormSpec) -> nn.Module:
    """The norm the spec names: RMSNorm for the built-in kinds, else the package's generated one."""
    if norm.kind in ("rms", "rms_1p"):
        return RMSNorm(width, norm.eps, norm.offset)
    return GeneratedNorm(width, norm.kind)


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * w * act(gate): the output norm of gated delta (silu) and KDA (sigmoid) layers."""

    def __init__(self, width: int, eps: float, activation: str = "silu"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps, self.activation = eps, activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return op("gated_rms_norm", x.device)(x, gate, self.weight, self.eps, self.activation)


class Weight(nn.Module):
    """A bare `.weight` holder, so parameters keep the release's names (e.g. `conv1d.weight`)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape))
