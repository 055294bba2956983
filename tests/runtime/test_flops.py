"""The FLOP count behind MFU, against torch's own FlopCounterMode on a real step of a tiny model."""
from __future__ import annotations

import json

import torch
from torch.utils.flop_counter import FlopCounterMode

from runtime.spec import SoftmaxAttention
from runtime.train.flops import mixing_flops, projection_flops_per_token
from runtime.lora.factors import LoraConfig, apply_lora
from runtime.model.decoder import HybridDecoder
from runtime.ops.attention.torch_form import visible_mask


def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """torch._grouped_mm: [S, K] x [E, K, N] (forward, input grad) or [K, S] x [S, N] (weight grad)."""
    if len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def test_projection_count_equals_torchs_matmul_count(example_package):
    """Forward plus input gradients of every frozen projection, LoRA's forward, input and weight gradients:
    the matmuls autograd runs when the embeddings need a gradient (qwen3_moe, LoRA on q/o and the experts)."""
    spec = json.loads((example_package("qwen3_moe") / "spec.json").read_text())
    model = HybridDecoder(spec)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(p.numel()))
    apply_lora(model, LoraConfig(rank=4, alpha=8, targets=("layers.*.attn.q_proj", "layers.*.attn.o_proj"), experts=True))
    embeds = torch.randn(1, 40, spec["hidden_size"], requires_grad=True)
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: _grouped_mm_flops})
    with counter:
        model(inputs_embeds_BTD=embeds).sum().backward()
    counted = counter.get_flop_counts()["Global"]
    matmuls = sum(v for op, v in counted.items() if "attention" not in str(op))
    assert matmuls == projection_flops_per_token(model) * 40


def test_softmax_pairs_follow_the_window():
    attention = SoftmaxAttention(num_heads=3, num_kv_heads=1, head_dim=8, rope=None, sliding_window=5)
    visible = int(visible_mask(37, True, 5, torch.device("cpu")).sum())
    assert mixing_flops(attention, 37) == (2 * 2 * 8 * 3 * visible, 0.0)
