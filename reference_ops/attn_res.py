"""fp64 reference for block attention residuals (Kimi's Attention Residuals, arXiv 2603.15031; Kimi K3's
`attn_res_block_size`): each sublayer's input is a softmax mix over depth of the completed blocks' sums and the
current block's partial sum, scored by a learned per-sublayer pseudo-query against the RMSNorm'd sources.

Shape legend: N sources (completed blocks, then the partial sum), ... any leading dims (B, T), D model width.
"""
from __future__ import annotations

import torch

from reference_ops.norms import rms_norm


def attn_res_mix(sources: tuple[torch.Tensor, ...], query_D: torch.Tensor, norm_weight_D: torch.Tensor,
                 eps: float, offset: float = 0.0) -> torch.Tensor:
    """h[...] = sum_n softmax_n(query . rms_norm(v_n)) v_n over the sources v_n [..., D] (the block sums, then the
    partial sum): the values are the sources as they are, only the scores see them normed. Returns h in fp64."""
    values_ND = torch.stack([s.double() for s in sources])
    scores_N = rms_norm(values_ND, norm_weight_D, eps, offset) @ query_D.double()
    return (scores_N.softmax(dim=0).unsqueeze(-1) * values_ND).sum(dim=0)
