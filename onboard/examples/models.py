"""Tiny released-model folders of real families, written by transformers' `save_pretrained`.

Random weights, real tensor naming and config keys. Used by `onboard example-model`, the demo and
the test fixtures. Every config keeps each family's distinctive features switched on (hybrid layer
patterns, shared experts, group-limited routing, sinks, partial rotary...) at toy widths.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from onboard.errors import BadInput
from onboard.examples.stored import encode_release, stored_release
from onboard.examples.tokenizer import write_example_tokenizer
from onboard.release.transformers_classes import model_class

_ATTN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
             max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
# head_dim is what transformers' MLA rotary tables are built with: the rope width
_MLA = dict(head_dim=8, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            intermediate_size=96, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)


def _gated_delta_text(num_layers: int) -> dict:
    return dict(_ATTN, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=32, intermediate_size=96,
                num_hidden_layers=num_layers, layer_types=_every_fourth("full_attention", "linear_attention", num_layers))


def _every_fourth(special: str, other: str, num_layers: int) -> list[str]:
    return [special if (i + 1) % 4 == 0 else other for i in range(num_layers)]


def _alternating(first: str, second: str, num_layers: int) -> list[str]:
    return [first if i % 2 == 0 else second for i in range(num_layers)]


def _config_kwargs(family: str, num_layers: int) -> dict:
    """Family -> kwargs for its transformers config class. `num_layers` is the text depth."""
    if family == "qwen3_next":
        return dict(_gated_delta_text(num_layers), norm_topk_prob=True,
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))
    if family == "qwen3_5_moe":
        # partial rotary 0.5 of head_dim 16 leaves 4 frequencies for the (t, h, w) sections
        text = dict(_gated_delta_text(num_layers), rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
            mrope_section=[2, 1, 1], mrope_interleaved=True))
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
                      temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
        return dict(text_config=text, vision_config=vision, image_token_id=250, video_token_id=251,
                    vision_start_token_id=252, vision_end_token_id=253, tie_word_embeddings=False)
    if family == "kimi_linear":
        return dict(_ATTN, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, v_head_dim=16, linear_head_dim=16, linear_num_heads=4,
                    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
                    moe_intermediate_size=32, intermediate_size=96, routed_scaling_factor=2.446,
                    num_expert_group=1, topk_group=1, moe_renormalize=True, num_hidden_layers=num_layers,
                    layer_types=_every_fourth("full_attention", "linear_attention", num_layers),
                    mlp_layer_types=["dense"] + ["sparse"] * (num_layers - 1))
    if family in ("deepseek_v3", "deepseek_v32"):
        kw = dict(_ATTN, **_MLA, n_group=4, topk_group=2, first_k_dense_replace=1, num_hidden_layers=num_layers)
        if family == "deepseek_v3":
            return dict(kw, rope_interleave=True)
        return dict(kw, index_n_heads=2, index_head_dim=16, index_topk=8,
                    mlp_layer_types=["dense"] + ["sparse"] * (num_layers - 1))
    if family == "qwen3_moe":
        return dict(_ATTN, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                    norm_topk_prob=True, num_hidden_layers=num_layers)
    if family in ("mixtral", "minimax"):
        kw = dict(_ATTN, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, num_hidden_layers=num_layers)
        if family == "minimax":
            kw.update(layer_types=_alternating("linear_attention", "full_attention", num_layers), block_size=16)
        return kw
    if family == "olmoe":
        return dict(_ATTN, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, intermediate_size=32,
                    num_hidden_layers=num_layers)
    if family == "gpt_oss":
        return dict(_ATTN, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=8,
                    num_hidden_layers=num_layers,
                    layer_types=_alternating("sliding_attention", "full_attention", num_layers),
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=64))
    if family == "ernie4_5_moe":
        return dict(_ATTN, moe_num_experts=8, moe_k=2, moe_num_shared_experts=1, moe_intermediate_size=32,
                    intermediate_size=96, moe_layer_start_index=1, moe_layer_end_index=num_layers - 1,
                    num_hidden_layers=num_layers, tie_word_embeddings=True)
    if family == "glm4_moe":
        return dict(_ATTN, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                    n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
                    norm_topk_prob=True, use_qk_norm=True, num_hidden_layers=num_layers,
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
    raise BadInput(None, "FAMILY", f"unknown family {family!r}; known: {', '.join(FAMILIES)}, kimi_k3")


FAMILIES = ("qwen3_next", "qwen3_5_moe", "kimi_linear", "deepseek_v32", "deepseek_v3", "qwen3_moe", "mixtral",
            "olmoe", "gpt_oss", "ernie4_5_moe", "minimax", "glm4_moe")
# Smallest depth that shows every layer kind of the family (hybrid patterns repeat every 4).
DEFAULT_LAYERS = {"qwen3_next": 4, "qwen3_5_moe": 4, "kimi_linear": 4, "minimax": 2, "gpt_oss": 2,
                  "deepseek_v3": 2, "deepseek_v32": 2, "glm4_moe": 2, "ernie4_5_moe": 3}


def example_config(family: str, num_layers: int | None = None):
    """The transformers config object of the tiny example."""
    from transformers import AutoConfig

    num_layers = num_layers or DEFAULT_LAYERS.get(family, 2)
    if num_layers < 1 or num_layers > 64:
        raise BadInput(None, "--layers", f"expected 1..64 layers, got {num_layers}")
    return AutoConfig.for_model(family, **_config_kwargs(family, num_layers))


def build_example(family: str, num_layers: int | None = None, seed: int = 0):
    """A randomly initialized transformers model of the tiny config, fp32, eval mode."""
    config = example_config(family, num_layers)
    torch.manual_seed(seed)
    model = model_class(family)(config)
    perturb(model, seed)
    return model.eval()


def perturb(model, seed: int) -> None:
    """Move every parameter off its init value (ones, zeros) so alignment can see wrong formulas:
    a norm weight of exactly 1 hides a missing (1 + w); a zero bias hides a missing bias."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)


def write_example_model(family: str, out_dir: Path, num_layers: int | None = None, num_shards: int = 1,
                        seed: int = 0, weights: str = "bf16") -> Path:
    """Write the release folder (config.json + safetensors, sharded when num_shards > 1) in bf16, or in the stored
    format the family's real release ships (`weights` fp8 / mxfp4: the bf16 example's weights re-encoded)."""
    release = None if weights == "bf16" else stored_release(_known(family), weights)
    _check_out_dir(Path(out_dir), num_shards)
    out = save_release(build_example(family, num_layers, seed), Path(out_dir), num_shards)
    if release is not None:
        encode_release(out, release)
    return out


def _known(family: str) -> str:
    if family not in FAMILIES:
        _config_kwargs(family, 1)  # raises the unknown-family BadInput
    return family


def _check_out_dir(out_dir: Path, num_shards: int) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):
        raise BadInput(out_dir, None, "output folder exists and is not empty")
    if num_shards < 1:
        raise BadInput(None, "--shards", f"expected at least 1 shard, got {num_shards}")


def save_release(model, out_dir: Path, num_shards: int = 1) -> Path:
    """save_pretrained in bf16, split into about num_shards safetensors shards."""
    model = model.to(torch.bfloat16)
    total_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    shard_bytes = max(1, math.ceil(total_bytes / num_shards)) if num_shards > 1 else "50GB"
    model.config.dtype = torch.bfloat16
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(out_dir, max_shard_size=shard_bytes)
    write_example_tokenizer(out_dir)
    return out_dir
