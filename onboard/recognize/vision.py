"""The vision tower: widths from vision_config, parameter count from the weights when their shapes are known."""
from __future__ import annotations

from math import prod

from onboard.release.config_view import ConfigView
from onboard.release.manifest import Manifest
from runtime.spec import WeightNaming, VisionSpec


def recognize(manifest: Manifest, top: ConfigView, naming: WeightNaming) -> VisionSpec | None:
    if manifest.vision_config is None:
        return None
    top.used.add("vision_config")
    v = ConfigView(manifest.vision_config, str(manifest.root / "config.json"), "vision_config")
    spec = dict(depth=v.positive_int("depth", "num_hidden_layers"), hidden_size=v.positive_int("hidden_size", "embed_dim"),
                intermediate_size=v.positive_int("intermediate_size"), num_heads=v.positive_int("num_heads", "num_attention_heads"),
                patch_size=v.positive_int("patch_size"), out_hidden_size=v.positive_int("out_hidden_size", default=0, allow_zero=True))
    merge = v.positive_int("spatial_merge_size", default=2)
    image_token = top.positive_int("image_token_id", "image_token_index", default=None, allow_zero=True)
    return VisionSpec(**spec, num_params=_count(manifest, naming, v, spec), model_type=v.get("model_type", default=None),
                      spatial_merge_size=merge, image_token_id=image_token)


def _count(manifest: Manifest, naming: WeightNaming, v: ConfigView, s: dict) -> int:
    prefix = naming.vision_prefix or "model.visual."
    shapes = [t.shape for name, t in manifest.tensors.items() if name.startswith(prefix)]
    if shapes and all(shape is not None for shape in shapes):
        return sum(prod(shape) for shape in shapes)
    # Index only: a Qwen-VL-style ViT (qkv/proj attention, two-layer MLP, LayerNorms, patch merger).
    h, i, out = s["hidden_size"], s["intermediate_size"], s["out_hidden_size"] or s["hidden_size"]
    block = (3 * h * h + 3 * h) + (h * h + h) + (2 * h * i + i + h) + 4 * h
    merge = v.positive_int("spatial_merge_size", default=2) ** 2
    merger = 2 * h + (h * merge) ** 2 + h * merge + h * merge * out + out
    patch = v.positive_int("in_channels", default=3) * v.positive_int("temporal_patch_size", default=2) * s["patch_size"] ** 2 * h
    return s["depth"] * block + merger + patch
