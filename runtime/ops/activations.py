"""Activation functions by the names releases give them (config `hidden_act`).

One table for the runtime's gated MLPs and experts; a package's generated activations are added to it
when the package loads (runtime/package_ops.py), so the registry's predicates see them too.
"""
from __future__ import annotations

import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
