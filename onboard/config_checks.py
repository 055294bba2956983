"""Reject config.json values no real model has: negative or absurd sizes, strings for numbers, NaN.

Which keys are sizes is decided by name (hidden_size, *_dim, num_*, ...), at any depth, so the
text and vision parts and per-layer lists are covered without knowing the family.
"""
from __future__ import annotations

import math
from pathlib import Path

from onboard.errors import OnboardError

# Widths, counts and ranks: far above any released model (largest vocabularies are ~1M).
WIDTH_LIMIT = 1 << 24
# Context lengths: 1M-token models exist; 2^31 leaves room and still catches garbage.
POSITION_LIMIT = 1 << 31

# The sizes the architecture is built from: a positive integer or null (derived/default).
CORE_KEYS = frozenset({
    "hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "moe_intermediate_size", "num_experts_per_tok", "n_routed_experts",
    "num_experts", "num_local_experts", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
})
POSITION_KEYS = frozenset({
    "max_position_embeddings", "original_max_position_embeddings", "n_positions", "n_ctx",
    "seq_length", "max_seq_len", "max_sequence_length",
})
# Every other key named like a size. Across transformers' 800+ default configs these hold 0
# ("none": n_shared_experts, qk_rope_head_dim for NoPE), -1 ("disabled": chunk_size), floats
# (mscale_all_dim) and flags (block_auto_adjust_ff_dim), so only strings, values below -1 and
# absurd sizes are rejected there.
SIZE_PREFIXES = ("num_", "n_")
SIZE_SUFFIXES = ("_size", "_dim", "_rank", "_topk")


def check_config_dims(config: dict, path: str | Path) -> None:
    """Walk config (nested dicts and lists) and raise OnboardError at the first bad value."""
    for key, value in config.items():
        _check_value(value, key, key, path)


def _check_value(value: object, key_path: str, key: str, path: str | Path) -> None:
    if isinstance(value, dict):
        for child, child_value in value.items():
            _check_value(child_value, f"{key_path}.{child}", child, path)
    elif isinstance(value, list):
        # list items keep the list's key: patch_size [14, 14] is checked as sizes
        for i, item in enumerate(value):
            _check_value(item, f"{key_path}[{i}]", key, path)
    elif isinstance(value, float) and not math.isfinite(value):
        raise OnboardError(path, key_path, f"must be a finite number, got {value}")
    elif value is not None:
        _check_named_size(value, key_path, key.lower(), path)


def _check_named_size(value: object, key_path: str, key: str, path: str | Path) -> None:
    if key in CORE_KEYS:
        _check_int(value, key_path, 1, WIDTH_LIMIT, path)
    elif key in POSITION_KEYS:
        _check_number(value, key_path, POSITION_LIMIT, path)
    elif key.startswith(SIZE_PREFIXES) or key.endswith(SIZE_SUFFIXES) or key == "head_dim":
        _check_number(value, key_path, WIDTH_LIMIT, path)


def _check_int(value: object, key_path: str, low: int, high: int, path: str | Path) -> None:
    # bool is a subclass of int in Python but never a size
    if type(value) is not int:
        raise OnboardError(path, key_path, f"must be an integer, got {type(value).__name__} {value!r:.40}")
    if not low <= value <= high:
        raise OnboardError(path, key_path, f"must be an integer in [{low}, {high}], got {value}")


def _check_number(value: object, key_path: str, high: int, path: str | Path) -> None:
    if isinstance(value, str):
        raise OnboardError(path, key_path, f"must be a number, got string {value!r:.40}")
    if type(value) is int:
        _check_int(value, key_path, -1, high, path)
