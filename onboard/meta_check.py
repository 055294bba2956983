"""Cross-check a ModelSpec against transformers' own model built on the meta device (no memory).

Only for families transformers knows. Compares the parameter count and, per layer, whether the
attention is linear and whether the FFN is a MoE.
"""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel

from onboard.config_checks import transformers_config
from onboard.errors import BadInput
from onboard.manifest import Manifest
from onboard.spec import ModelSpec


class MetaCheck(BaseModel):
    model_class: str
    params: int
    params_agree: bool
    layer_disagreements: list[str]

    @property
    def agrees(self) -> bool:
        return self.params_agree and not self.layer_disagreements


def _build_on_meta(manifest: Manifest):
    import torch
    from transformers.models.auto import modeling_auto as auto

    family = manifest.config.get("model_type")
    names = {**auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, **auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES}
    if family not in names:
        return None
    # built from a copy: transformers' config class may refuse the values (bad input) or edit them
    config = transformers_config(manifest.config, manifest.root / "config.json")
    cls = getattr(__import__("transformers"), names[family])
    with torch.device("meta"):
        return cls(config)


def _decoder_layers(model):
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if layers is not None and hasattr(module, "embed_tokens"):
            return list(layers)
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
    try:
        model = _build_on_meta(manifest)
    except BadInput:
        raise
    # a config its class accepts but its model cannot be built from (an activation transformers
    # does not know, a padding id beyond the vocabulary): the cross-check failed, a disagreement
    except Exception as exc:  # noqa: BLE001
        return MetaCheck(model_class="(not built)", params=0, params_agree=False,
                         layer_disagreements=[f"transformers could not build the model: {type(exc).__name__}: {str(exc)[:200]}"])
    if model is None:
        return None
    # Persistent buffers count too: releases store them (DeepSeek's correction bias, MiniMax decays)
    saved = set(model.state_dict().keys())
    params = sum(p.numel() for p in model.parameters())
    params += sum(b.numel() for name, b in model.named_buffers() if name in saved)
    problems = []
    for layer_spec, layer in zip(spec.layers, _decoder_layers(model)):
        linear = layer_spec.attention.kind in ("gated_delta", "kda", "lightning")
        if linear != _is_linear_attention(layer):
            problems.append(f"layer {layer_spec.index}: spec linear={linear}, transformers {type(layer).__name__}")
        if (layer_spec.ffn.kind == "moe") != _is_moe(layer):
            problems.append(f"layer {layer_spec.index}: spec ffn={layer_spec.ffn.kind}, transformers disagrees")
    return MetaCheck(model_class=type(model).__name__, params=params,
                     params_agree=params == spec.params.total + spec.params.buffers, layer_disagreements=problems)
