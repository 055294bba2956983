"""`python -m onboard.examples.kimi_k3.build OUT SEED NUM_SHARDS WEIGHTS`: the example release's weights, written by
the release's own model class (random init, then moved off the init values) through save_pretrained.

Run by the writer in a subprocess, so the process that writes the release (the CLI, a test) never imports the
release's code. Tensors are bf16 except those the release keeps in fp32 (conv weights, decay and bias vectors,
the latent norm), as the released checkpoint stores them. WEIGHTS "mxfp4": the routed experts are the release's
MXFP4 modules, filled with random weights encoded by runtime/formats/codec.py.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from onboard.examples.kimi_k3.config import config_kwargs

FP32_SUFFIXES = ("conv1d.weight", ".A_log", ".dt_bias", ".e_score_correction_bias", "routed_expert_norm.weight",
                 "o_norm.weight")


def build(seed: int, weights: str = "bf16"):
    from onboard.examples.kimi_k3.release_code.configuration_kimi_k3 import KimiK3Config
    from onboard.examples.kimi_k3.release_code.modeling_kimi_k3 import KimiK3ForConditionalGeneration, MXFP4Linear

    torch.manual_seed(seed)
    model = KimiK3ForConditionalGeneration(KimiK3Config(**config_kwargs(weights)))
    _perturb(model, seed)
    _fill_packed(model, seed, MXFP4Linear)
    return model.eval()


def _fill_packed(model, seed: int, packed_class) -> None:
    """Random weights (as nn.Linear initializes them, moved off init like the rest) stored as MXFP4."""
    from runtime.formats.codec import mxfp4_encode

    gen = torch.Generator().manual_seed(seed + 2)
    for module in model.modules():
        if isinstance(module, packed_class):
            rows, cols = module.weight_packed.shape[0], module.weight_packed.shape[1] * 2
            weight = (torch.rand(rows, cols, generator=gen) * 2 - 1) * cols ** -0.5
            module.weight_packed, module.weight_scale = mxfp4_encode(weight + torch.randn(rows, cols, generator=gen) * 0.05)


def _perturb(model, seed: int) -> None:
    """Every tensor off its init value (a norm of ones hides a missing weight); A_log's padding stays zero."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if not tensor.is_floating_point():
                continue  # packed codes: filled by _fill_packed
            tensor.add_(torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype) * 0.05)
            if name.endswith(".A_log"):
                heads = model.config.text_config.linear_attn_config["num_heads"]
                tensor[heads:] = 0


def _to_release_dtypes(model) -> None:
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(torch.float32 if name.endswith(FP32_SUFFIXES) else torch.bfloat16)


def main(out: Path, seed: int, num_shards: int, weights: str) -> None:
    from transformers.utils import logging as hf_logging

    model = build(seed, weights)
    _to_release_dtypes(model)
    model.config.dtype = torch.bfloat16
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    hf_logging.disable_progress_bar()
    model.save_pretrained(out, max_shard_size=math.ceil(total / num_shards) if num_shards > 1 else "50GB")
    print(json.dumps({"tensors": len(model.state_dict())}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
