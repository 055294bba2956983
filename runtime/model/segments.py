"""Packed sequences: ops without their own cu_seqlens argument run once per segment.

cu_seqlens (int32, [num_segments + 1], starting at 0 and ending at T) marks where the packed
segments of a batch-1 sequence start, as fla and the fused delta-rule kernels take it.
"""
from __future__ import annotations

from typing import Callable

import torch


def per_segment(fn: Callable[..., torch.Tensor], cu_seqlens: torch.Tensor | None, *seq_tensors: torch.Tensor):
    """fn(*slices) for each segment's slice of seq_tensors along dim 1, outputs concatenated along dim 1;
    fn(*seq_tensors) when there is no packing."""
    if cu_seqlens is None:
        return fn(*seq_tensors)
    if seq_tensors[0].shape[0] != 1:
        raise ValueError(f"cu_seqlens needs batch 1, got a tensor of shape {tuple(seq_tensors[0].shape)}")
    # one segment is the whole sequence: its bounds are known without reading them from the device (a sync)
    if cu_seqlens.numel() == 2:
        return fn(*seq_tensors)
    bounds = cu_seqlens.tolist()
    outputs = [fn(*(t[:, start:end] for t in seq_tensors)) for start, end in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outputs, dim=1)
