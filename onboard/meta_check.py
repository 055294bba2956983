"""Cross-check a ModelSpec against transformers' own model built on the meta device (no memory).

Only for families transformers knows. Compares the parameter count and, per layer, whether the
attention is linear and whether the FFN is a MoE.
"""
from __future__ import annotations

import functools
import json
from typing import Optional

from pydantic import BaseModel

from onboard.manifest import Manifest
from onboard.spec import ModelSpec
from runtime.own_modules import text_decoder, transformers_class, transformers_class_names  # noqa: F401 (gap reads it here)


class MetaCheck(BaseModel):
    model_class: str
    params: int
    params_agree: bool
    layer_disagreements: list[str]

    @property
    def agrees(self) -> bool:
        return self.params_agree and not self.layer_disagreements


def _build_on_meta(manifest: Manifest):
    return _build_from_json(json.dumps(manifest.config, sort_keys=True))


@functools.lru_cache(maxsize=2)
def _build_from_json(config_json: str):
    import torch
    from transformers import AutoConfig

    config = json.loads(config_json)
    cls = transformers_class(str(config.get("model_type")))
    if cls is None:
        return None
    config = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("transformers_version",)})
    with torch.device("meta"):
        return cls(config)


def transformers_tensors(manifest: Manifest) -> Optional[dict[str, tuple[int, ...]]]:
    """Released name -> shape that transformers' own model of this config saves (None: family unknown)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model = _build_on_meta(manifest)
    if model is None:
        return None
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    return {name: tuple(t.shape) for name, t in revert_weight_conversion(model, state).items()}


def _decoder_layers(model):
    try:
        return list(text_decoder(model).layers)
    except StopIteration:
        return []


def _is_linear_attention(layer) -> bool:
    if hasattr(layer, "linear_attn"):
        return True
    attn = getattr(layer, "self_attn", None)
    name = type(attn).__name__.lower()
    return any(word in name for word in ("delta", "lightning"))


def _is_moe(layer) -> bool:
    ffn = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
    return ffn is not None and any(hasattr(ffn, a) for a in ("experts", "router", "gate"))


def meta_check(spec: ModelSpec, manifest: Manifest) -> Optional[MetaCheck]:
    model = _build_on_meta(manifest)
    if model is None:
        return None
    # Persistent buffers count too: releases store them (DeepSeek's correction bias, MiniMax decays)
    saved = set(model.state_dict().keys())
    params = sum(p.numel() for p in model.parameters())
    params += sum(b.numel() for name, b in model.named_buffers() if name in saved)
    problems = []
    for layer_spec, layer in zip(spec.layers, _decoder_layers(model)):
        if "own_module" in (layer_spec.attention.kind, layer_spec.ffn.kind):
            continue  # judged by the module itself
        linear = layer_spec.attention.kind in ("gated_delta", "kda", "lightning")
        if linear != _is_linear_attention(layer):
            problems.append(f"layer {layer_spec.index}: spec linear={linear}, transformers {type(layer).__name__}")
        if (layer_spec.ffn.kind == "moe") != _is_moe(layer):
            problems.append(f"layer {layer_spec.index}: spec ffn={layer_spec.ffn.kind}, transformers disagrees")
    return MetaCheck(model_class=type(model).__name__, params=params,
                     params_agree=params == spec.params.total + spec.params.buffers, layer_disagreements=problems)
