"""Config access that remembers which keys recognition used, so the rest can be reported as unrecognized."""
from __future__ import annotations

from typing import Any

from onboard.release.key_kinds import GENERATION_KEYS

_MISSING = object()


class NotRecognized(Exception):
    """A recognition rule that does not hold for this release: a gap (exit 3), never bad input.

    Our key names, value ranges and width relations are assumptions; a valid release of another
    design breaks them, and the component they describe is then run through its own module."""

    def __init__(self, key: str, message: str):
        self.key, self.message = key, message
        super().__init__(f"{key}: {message}")

# Keys that carry no architecture (training, generation, bookkeeping): never reported.
IGNORED_KEYS = frozenset({
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "output_router_logits",
    "router_aux_loss_coef", "attention_dropout", "output_attentions", "output_hidden_states", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder", "problem_type", "_name_or_path", "id2label", "label2id",
    "tokenizer_class", "max_position_embeddings", "model_max_length", "router_jitter_noise", "pretraining_tp",
    "aux_loss_alpha", "seq_aux", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "torchscript",
    "num_nextn_predict_layers", "bos_token", "eos_token", "image_token_id",
    "video_token_id", "vision_start_token_id", "vision_end_token_id", "router_z_loss_coef",
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "use_sliding_window", "initializer_factor", "moe_use_aux_free", "max_window_layers",
    "tie_embeddings", "use_return_dict", "_attn_implementation_autoset", "rope_scaling",
    "default_theta", "layer_norm_eps", "hidden_dropout", "embedding_dropout", "in_channels",
    "temporal_patch_size", "num_position_embeddings", "initializer_std", "deepstack_visual_indexes",
})


class ConfigView:
    """Read a config dict by alias lists; `unused()` lists what was never read."""

    def __init__(self, data: dict, path: str, source: str):
        self.data = data
        self.path = path  # file path for error messages
        self.source = source  # dotted prefix, e.g. "text_config"
        self.used: set[str] = set()

    def has(self, *keys: str) -> bool:
        return any(k in self.data and self.data[k] is not None for k in keys)

    def get(self, *keys: str, default: Any = _MISSING) -> Any:
        for key in keys:
            if key in self.data and self.data[key] is not None:
                self.used.add(key)
                return self.data[key]
        for key in keys:
            self.used.add(key)
        if default is _MISSING:
            raise NotRecognized(self._dotted(keys[0]), f"missing (also looked for {', '.join(keys[1:]) or 'no alias'})")
        return default

    def positive_int(self, *keys: str, default: Any = _MISSING, allow_zero: bool = False) -> int:
        value = self.get(*keys, default=default)
        if value is None:
            return value
        low = 0 if allow_zero else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low or value > (1 << 31):
            raise NotRecognized(self._dotted(keys[0]), f"recognized for integers >= {low}, got {value!r}")
        return value

    def number(self, *keys: str, default: Any = _MISSING) -> float:
        value = self.get(*keys, default=default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise NotRecognized(self._dotted(keys[0]), f"recognized for numbers, got {value!r}")
        return float(value)

    def unused(self) -> list[str]:
        """Architecture keys recognition never read (generation settings are listed apart: key_kinds.py)."""
        return [self._dotted(k) for k, v in self.data.items()
                if k not in self.used and k not in IGNORED_KEYS and k not in GENERATION_KEYS and v is not None]

    def mark_used(self, *keys: str) -> None:
        """Keys whose meaning recognition takes from elsewhere (the weights, a derived width)."""
        self.used.update(keys)

    def _dotted(self, key: str) -> str:
        return f"{self.source}.{key}" if self.source else key
