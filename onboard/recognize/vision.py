"""The vision tower: widths from vision_config, parameter count from the weights when their shapes are known."""
from __future__ import annotations

from math import prod

from onboard.release.config_view import ConfigView, NotRecognized
from onboard.release.manifest import Manifest
from onboard.release.naming import outside_text
from onboard.release.transformers_classes import transformers_may_know
from runtime.spec import WeightNaming, VisionSpec

# the vision config's keys by their names in transformers' configs, then in Kimi's (vt_*, text_hidden_size)
DEPTH_KEYS = ("depth", "num_hidden_layers", "vt_num_hidden_layers")
HIDDEN_KEYS = ("hidden_size", "embed_dim", "vt_hidden_size")
IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index", "media_placeholder_token_id")


def recognize(manifest: Manifest, top: ConfigView, naming: WeightNaming) -> VisionSpec | None:
    if manifest.vision_config is None:
        return None
    top.used.add("vision_config")
    v = ConfigView(manifest.vision_config, str(manifest.root / "config.json"), "vision_config")
    _known_tower(manifest, v, naming)
    spec = dict(depth=v.positive_int(*DEPTH_KEYS), hidden_size=v.positive_int(*HIDDEN_KEYS),
                intermediate_size=v.positive_int("intermediate_size", "vt_intermediate_size"),
                num_heads=v.positive_int("num_heads", "num_attention_heads", "vt_num_attention_heads"),
                patch_size=v.positive_int("patch_size"),
                out_hidden_size=v.positive_int("out_hidden_size", "text_hidden_size", default=0, allow_zero=True))
    merge = v.positive_int("spatial_merge_size", default=2)
    image_token = top.positive_int(*IMAGE_TOKEN_KEYS, default=None, allow_zero=True)
    return VisionSpec(**spec, num_params=_count(manifest, naming, v, spec), model_type=v.get("model_type", default=None),
                      spatial_merge_size=merge, image_token_id=image_token)


def _known_tower(manifest: Manifest, v: ConfigView, naming: WeightNaming) -> None:
    """The runtime builds the tower as transformers' model of its model_type: a type transformers does not know
    (a release's own tower, only its code builds) is a gap, named with what its config and tensors say."""
    model_type = v.data.get("model_type")
    if model_type is None or transformers_may_know(str(model_type)):
        return
    depth = next((v.data[k] for k in DEPTH_KEYS if isinstance(v.data.get(k), int)), None)
    width = next((v.data[k] for k in HIDDEN_KEYS if isinstance(v.data.get(k), int)), None)
    tensors = outside_text(manifest.tensors, naming)
    v.mark_used(*v.data)
    raise NotRecognized("vision_config.model_type", f"a vision tower of model type {model_type!r} ({depth} blocks of width "
                        f"{width}; {len(tensors)} tensors outside the text model, under "
                        f"{', '.join(sorted({n.split('.')[0] + '.' for n in tensors}))}) that transformers does not know: "
                        "only the release's own code builds it")


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
