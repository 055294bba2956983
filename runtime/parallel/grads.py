"""Global gradient-norm clipping over sharded and plain parameters alike.

Every gradient element lives on exactly one rank (FSDP shards, experts owned once: placement.py), so the
squared norm is the sum over ranks of each rank's local squares; torch's clip_grad_norm_ would stack
norms of DTensors on different meshes (experts: dp_shard x ep; dense: the flattened world), which fails.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients so their global L2 norm is at most max_norm; returns the norm before (fp32)."""
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    by_dtype = {}
    for g in local:
        by_dtype.setdefault(g.dtype, []).append(g)
    # foreach kernels: a few launches for all factors instead of three per factor; each norm in fp32, also of
    # bf16 gradients (a bf16 norm would round the total to 3 digits)
    squares = sum((torch.stack(torch._foreach_norm(gs, 2, dtype=torch.float32)).square().sum()
                   for gs in by_dtype.values()), torch.zeros((), device=local[0].device))
    if dist.is_initialized() and any(hasattr(g, "to_local") for g in grads):
        dist.all_reduce(squares)
    norm = squares.sqrt()
    # torch's clip_grad_norm_ rule: scale by max_norm / (norm + 1e-6), never up
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for dtype, gs in by_dtype.items():
        torch._foreach_mul_(gs, scale.to(dtype))
    return norm
