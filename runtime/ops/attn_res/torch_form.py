"""Torch form of block attention residuals' mix (contract: reference_ops/attn_res.py): scores and softmax in fp32,
the weighted sum of the sources in fp32, returned in the sources' dtype. Runs everywhere, any dtype.

Shape legend: N sources (completed blocks, then the partial sum), ... any leading dims (B, T), D model width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def attn_res_mix(sources: tuple[torch.Tensor, ...], query_D: torch.Tensor, norm_weight_D: torch.Tensor,
                 eps: float, offset: float = 0.0) -> torch.Tensor:
    """sum_n softmax_n(query . rms_norm(v_n)) v_n; the query's and norm's weights folded into one [D] vector."""
    values_ND = torch.stack(sources).float()
    scale_D = norm_weight_D.float() + offset if offset else norm_weight_D.float()
    # query . (v / rms(v) * w) = ((w * query) . v) / rms(v): one [D] vector and one rms per source and token
    scores_N = (values_ND @ (scale_D * query_D.float())) * torch.rsqrt(values_ND.pow(2).mean(-1) + eps)
    return (F.softmax(scores_N, dim=0).unsqueeze(-1) * values_ND).sum(dim=0).to(sources[0].dtype)
