"""Block attention residuals (Kimi K3; arXiv 2603.15031): the mix in front of each sublayer and the final norm.

The residual stream is a list of sources: the completed blocks' sums (the embedding is the first), then the current
block's partial sum. A sublayer reads the softmax mix of the sources (runtime/ops/attn_res) and adds its output to
the partial sum; a layer that starts a block first closes the partial sum into the list of blocks.
Shape legend: B batch, T tokens, D model width.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.dispatch import op
from runtime.model.layers.lora_linear import weight_of
from runtime.model.layers.norm import RMSNorm
from runtime.spec import AttnResSpec, NormSpec


class AttnResMix(nn.Module):
    """One learned pseudo-query (released as a [1, D] linear, `*_res_proj`) and the RMSNorm its scores read the
    sources through (`*_res_norm`: an RMSNorm at the model's eps and weight offset)."""

    def __init__(self, hidden_size: int, norm: NormSpec):
        super().__init__()
        self.query = nn.Linear(hidden_size, 1, bias=False)
        self.norm = RMSNorm(hidden_size, norm.eps, norm.offset)

    def forward(self, sources: tuple[torch.Tensor, ...]) -> torch.Tensor:
        mix = op("attn_res_mix", sources[0].device)
        return mix(tuple(sources), weight_of(self.query)[0], self.norm.weight, self.norm.eps, self.norm.offset)


def starts_block(attn_res: AttnResSpec, index: int) -> bool:
    """Whether layer `index` closes the partial sum into a block before its attention: block_size counts sublayers,
    two a layer, as Kimi K3's modeling code reads attn_res_block_size."""
    return index % max(1, attn_res.block_size // 2) == 0
