"""What tier 1 compares of a layer's backward, on either reference (transformers' layer or the release's own code,
run confined): the LoRA-targetable weights, the cotangent both sides' outputs get, and where an own module's
weights live."""
from __future__ import annotations

import re

import torch

from runtime.model.own_modules import OwnModule

LORA_TARGETS = re.compile(r"(?:^|\.)(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|in_proj_\w+|"
                          r"out_proj|qkv_proj|gate_proj|up_proj|down_proj)\.weight$")


def cotangent(shape, seed: int) -> torch.Tensor:
    """The gradient both sides' layer outputs get (the sandboxed reference draws the same one)."""
    # a stream apart from the token seed, so the cotangent is unrelated to the inputs
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + 7919), dtype=torch.float64)


def own_or_ours(part):
    """An own module's LoRA targets are transformers' module's own parameters, named as there."""
    return part.module if isinstance(part, OwnModule) else part
