"""Cross-check a ModelSpec against transformers' own model built on the meta device (no memory).

Only for families transformers knows. Compares the parameter count and, per layer, whether the
attention is linear and whether the FFN is a MoE.
"""
from __future__ import annotations

import functools
import inspect
import json
from typing import Optional

from pydantic import BaseModel

from onboard.errors import BadInput
from onboard.release.config_checks import transformers_config
from onboard.release.manifest import Manifest
from runtime.spec import ModelSpec
from onboard.release.transformers_classes import model_class, transformers_class_names, transformers_may_know  # noqa: F401 (gap reads it here)


NOT_BUILT = "(not built)"


class MetaCheck(BaseModel):
    model_class: str
    params: int
    params_agree: bool
    layer_disagreements: list[str]

    @property
    def agrees(self) -> bool:
        return self.params_agree and not self.layer_disagreements

    @property
    def built(self) -> bool:
        """transformers built its model of the release (its modules exist to run as the release's own)."""
        return self.model_class != NOT_BUILT


def _build_on_meta(manifest: Manifest):
    return _build_from_json(json.dumps(manifest.config, sort_keys=True), str(manifest.root / "config.json"))


@functools.lru_cache(maxsize=2)
def _build_from_json(config_json: str, config_path: str):
    import torch

    config = json.loads(config_json)
    cls = model_class(str(config.get("model_type")))
    if cls is None:
        return None
    # built from a copy: transformers' config class may refuse the values (bad input) or edit them
    config = transformers_config(config, config_path)
    with torch.device("meta"):
        return cls(config)


def transformers_tensors(manifest: Manifest) -> Optional[dict[str, tuple[int, ...]]]:
    """Released name -> shape that transformers' own model of this config saves (None: family unknown)."""
    if not transformers_may_know(str(manifest.config.get("model_type"))):
        return None
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    try:
        model = _build_on_meta(manifest)
    except BadInput:
        raise
    # a config its class accepts but its model cannot be built from: no oracle (meta_check reports why)
    except Exception:  # noqa: BLE001
        return None
    if model is None:
        return None
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    return {name: tuple(t.shape) for name, t in revert_weight_conversion(model, state).items()}


def _decoder_layers(model):
    try:
        from runtime.model.own_modules import text_decoder

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
    try:
        model = _build_on_meta(manifest)
    except BadInput:
        raise
    # a config its class accepts but its model cannot be built from (an activation transformers
    # does not know, a padding id beyond the vocabulary): the cross-check failed, a disagreement
    except Exception as exc:  # noqa: BLE001
        return MetaCheck(model_class=NOT_BUILT, params=0, params_agree=False,
                         layer_disagreements=[f"transformers could not build the model: {type(exc).__name__}: {str(exc)[:200]}"])
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


def transformers_parameter_names(manifest: Manifest, names: list[str]) -> dict[str, str]:
    """Released name -> the name transformers' model loads it as (after its checkpoint renamings), for a
    model that runs whole as transformers' own; a name a converter reshapes keeps its renamed key."""
    return {name: key for name, (key, _) in _loading(manifest, tuple(names)).items()}


def transformers_reshaped(manifest: Manifest, names: list[str]) -> set[str]:
    """The released names that transformers' conversion splits or fuses on loading (e.g. a fused
    query_key_value into q_proj, k_proj, v_proj): no one module of its model holds such a tensor."""
    return {name for name, (_, reshaped) in _loading(manifest, tuple(names)).items() if reshaped}


def _loading(manifest: Manifest, names: tuple[str, ...]) -> dict[str, tuple[str, bool]]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    model = _build_on_meta(manifest)
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_state = model.state_dict()
    out = {}
    for name in names:
        key, converter = rename_source_key(name, renamings, converters, model.base_model_prefix, meta_state)
        out[name] = (key, converter is not None)
    return out


def transformers_attention_linears(manifest: Manifest) -> set[str]:
    """transformers' names of the nn.Linear modules (exactly that class, as the runtime's LoRA takes) inside an
    attention module of its model of this release: a module whose class transformers names *Attention / *Attn,
    or, where it names none so (LongCat's *MLA), the innermost module whose forward takes the attention mask. A router
    inside it (a mixture of attention heads, *Router / *Gating) is left out, as the MoE router is."""
    from torch import nn

    model = _build_on_meta(manifest)
    routers = [name for name, m in model.named_modules() if any(w in type(m).__name__ for w in ("Router", "Gating"))]
    out = set()
    named = [(name, m) for name, m in model.named_modules() if any(w in type(m).__name__ for w in ("Attention", "Attn"))]
    # only where transformers names no module so: a state-space mixer of a hybrid also takes the mask
    for name, module in named or [(name, m) for name, m in model.named_modules() if _innermost_mask_taker(m)]:
        out |= {f"{name}.{n}" for n, m in module.named_modules() if type(m) is nn.Linear}
    return {n for n in out if not any(n.startswith(f"{r}.") for r in routers)}


def _takes_mask(module) -> bool:
    return "attention_mask" in inspect.signature(module.forward).parameters


def _innermost_mask_taker(module) -> bool:
    """A decoder layer takes the mask to hand it on: the module that uses it is the one below which none does."""
    return _takes_mask(module) and not any(_takes_mask(m) for m in list(module.modules())[1:])


class _FirstLayerInput(Exception):
    """Raised by the first decoder layer's stand-in, carrying the shape of the hidden states it was handed."""


def glue_reshapes(manifest: Manifest) -> Optional[str]:
    """Why the decoder's glue before its layers is not plain: transformers' decoder (meta tensors) hands its
    first layer hidden states shaped otherwise than the token embeddings (e.g. several residual streams);
    None when it hands them on as they are, or when the decoder cannot run on the meta device."""
    import torch
    from torch import nn

    from runtime.model.own_modules import text_decoder

    model = _build_on_meta(manifest)
    try:
        decoder = text_decoder(model)
    except StopIteration:
        return None
    width = next(m for m in decoder.children() if isinstance(m, nn.Embedding)).embedding_dim
    first = decoder.layers[0]

    def stand_in(hidden_states, *args, **kwargs):
        raise _FirstLayerInput(tuple(hidden_states.shape))

    first.forward = stand_in  # an instance attribute shadows the class's forward
    try:
        decoder(inputs_embeds=torch.zeros(1, 4, width, device="meta"), use_cache=False)
    except _FirstLayerInput as handed:
        shape = handed.args[0]
        return None if shape == (1, 4, width) else f"the decoder hands its layers hidden states {shape} for embeddings (1, 4, {width})"
    except Exception:  # a decoder that needs real data before its layers: no conclusion
        return None
    finally:
        del first.forward
    return None


def rope_pairs_interleaved(manifest: Manifest) -> Optional[bool]:
    """Whether the release's attention rotates adjacent channel pairs (interleaved) rather than halves, read
    off transformers' own rotary function: a query with only channel 0 set, rotated at position 1, scores
    against a key with only channel 1 set (interleaved) or channel d/2 (halves), at position 0. Scores, not
    output channels: some interleaved functions also permute the channels they return. None when the
    attention does not name exactly one rotary function, or it cannot be called with its decoder's tables."""
    if not transformers_may_know(str(manifest.config.get("model_type"))):
        return None  # without importing transformers (inspect of an unknown family stays light)
    import sys

    import torch

    from runtime.model.own_modules import text_decoder

    try:
        decoder = text_decoder(_build_on_meta(manifest))
        attention = next(m for m in decoder.layers[0].modules() if "Attention" in type(m).__name__)
        names = {n for n in inspect.unwrap(type(attention).forward).__code__.co_names if n.startswith("apply_rotary")}
        if len(names) != 1:
            return None
        rotate = getattr(sys.modules[type(attention).__module__], names.pop())
        rotary = type(decoder.rotary_emb)(config=decoder.config)
        at = [rotary(torch.zeros(1), torch.tensor([[p]])) for p in (0, 1)]
        at = [t if isinstance(t, tuple) else (t,) for t in at]
        width = at[0][0].shape[-1] * (2 if at[0][0].is_complex() else 1)
        query = _rotated(rotate, at[1], 0, width)
        pair, half = (float(query @ _rotated(rotate, at[0], c, width)) for c in (1, width // 2))
    except Exception:  # an attention or rotary module built otherwise: no conclusion
        return None
    if abs(pair) > 1e-6 > abs(half):
        return True
    return False if abs(half) > 1e-6 > abs(pair) else None


def _rotated(rotate, tables: tuple, channel: int, width: int):
    """A unit vector along `channel`, through transformers' rotary function as its query."""
    import torch

    unit = torch.zeros(1, 1, 1, width)
    unit[..., channel] = 1.0
    return rotate(unit, unit.clone(), *tables)[0].flatten()


def transformers_layer_count(manifest: Manifest) -> Optional[int]:
    """How many decoder layers transformers' model of this release has (its config may say it otherwise than by
    a layer-count key, e.g. by a list of block types); None when transformers cannot build it."""
    from runtime.model.own_modules import text_decoder

    if not transformers_may_know(str(manifest.config.get("model_type"))):
        return None
    try:
        model = _build_on_meta(manifest)
        return None if model is None else len(text_decoder(model).layers)
    # no model to count (bad values are judged where the spec is cross-checked): the missing key stays the gap
    except Exception:  # noqa: BLE001
        return None


def transformers_decoder_layers(manifest: Manifest) -> str:
    """transformers' name of its text decoder's layer list, e.g. "model.language_model.layers"."""
    from runtime.model.own_modules import text_decoder

    model = _build_on_meta(manifest)
    decoder = text_decoder(model)
    return next(f"{name}.layers" if name else "layers" for name, m in model.named_modules() if m is decoder)
