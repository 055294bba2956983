"""Reject config.json values no valid release has, before anything reads them.

Four kinds of check, each a BadInput naming the key: sizes decided by name at any depth
(hidden_size, *_dim, num_*: right type, bounded), the JSON type of the keys recognition reads,
relations between fields (top_k <= experts, kv heads dividing heads, eps > 0), and per-layer
lists against the layer count (one entry per layer, layer indices inside the model). Nesting
depth, string and list lengths, lone surrogates and the count keys against the release's
tensors are bounded too.
What a family's transformers config class refuses is refused as well (`transformers_config`).
"""
from __future__ import annotations

import copy
import math
import re
from pathlib import Path

from onboard.errors import BadInput

# Widths, counts and ranks: far above any released model (largest vocabularies are ~1M).
WIDTH_LIMIT = 1 << 24
# Context lengths: 1M-token models exist; 2^31 leaves room and still catches garbage.
POSITION_LIMIT = 1 << 31
# Real configs nest 4-6 levels (quantization_config groups); the walk and transformers' own
# recursive copies stay far from Python's recursion limit.
MAX_DEPTH = 32
# Config strings are names and short values: the longest across transformers' 829 default
# configs has 37 characters. Anything this long is not a config value, and every later step
# that prints or matches it pays for its length.
MAX_STRING_CHARS = 4096
# The longest list across those defaults is layer_types (80 items); a quantization config may
# name modules per layer and per expert. Lists above this bound are refused before any walk.
MIN_LIST_ITEMS = 4096
LIST_ITEMS_PER_LAYER = 1024

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
# Epsilons of normalizations: a division by zero or a negative variance otherwise.
EPS_KEYS = frozenset({"rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon"})

NUMBER = (int, float)
# The JSON type of each key recognition reads without a size check (null always means "default").
# Checked at the top level and in the text and vision parts, where recognition reads them.
KEY_TYPES: dict[str, tuple[type, ...]] = {
    "model_type": (str,), "architectures": (list,), "torch_dtype": (str,), "dtype": (str,),
    "hidden_act": (str,), "scoring_func": (str,), "topk_method": (str,), "auto_map": (dict,),
    "layer_types": (list,), "mlp_layer_types": (list,), "mlp_only_layers": (list,), "attn_type_list": (list,),
    "rope_parameters": (dict,), "rope_scaling": (dict,), "linear_attn_config": (dict,),
    "rope_theta": NUMBER, "partial_rotary_factor": NUMBER, "routed_scaling_factor": NUMBER,
    "swiglu_limit": NUMBER, "swiglu_alpha": NUMBER, "moe_norm_min": NUMBER,
    "tie_word_embeddings": (bool,), "norm_topk_prob": (bool,), "moe_renormalize": (bool,), "rope_interleave": (bool,),
}
# Inside rope_parameters / rope_scaling (or each per-layer-type dict of them).
ROPE_KEY_TYPES: dict[str, tuple[type, ...]] = {
    "rope_type": (str,), "type": (str,), "rope_theta": NUMBER, "partial_rotary_factor": NUMBER, "factor": NUMBER,
    "mrope_section": (list,), "mrope_interleaved": (bool,),
}
# Items of the list-valued keys above.
ITEM_TYPES: dict[str, tuple[type, ...]] = {
    "architectures": (str,), "layer_types": (str,), "mlp_layer_types": (str,), "mlp_only_layers": (int,),
    "attn_type_list": (int,), "mrope_section": (int,),
}
# Numbers meaningful only above zero: the rotary base (its powers are the frequencies) and, inside the rope
# dicts, the scaling factor (positions are divided by it).
POSITIVE_KEYS = ("rope_theta",)
ROPE_POSITIVE_KEYS = ("rope_theta", "factor")
ROPE_KEYS = ("rope_parameters", "rope_scaling")
EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk")
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer")
PER_EXPERT_NAME = re.compile(r"experts\.\d")
# One entry per decoder layer, as transformers' config classes require of the first two.
PER_LAYER_KEYS = ("layer_types", "mlp_layer_types", "attn_type_list")
# Lists of decoder layer indices (0-based).
LAYER_INDEX_KEYS = ("mlp_only_layers",)
# Kimi's linear_attn_config numbers its layers from 1 (its config class fills layer_types[layer - 1]).
ONE_BASED_INDEX_KEYS = ("full_attn_layers", "kda_layers")
PART_KEYS = ("text_config", "language_config", "llm_config", "vision_config", "vit_config", "visual")


def check_config(config: dict, path: str | Path) -> None:
    """Every check that needs only config.json; raises BadInput at the first bad value."""
    check_config_dims(config, path)
    for prefix, part in _parts(config):
        _check_key_types(part, KEY_TYPES, prefix, path)
        _check_positive(part, POSITIVE_KEYS, prefix, path)
        for key, rope in _rope_dicts(part):
            _check_key_types(rope, ROPE_KEY_TYPES, f"{prefix}{key}.", path)
            _check_positive(rope, ROPE_POSITIVE_KEYS, f"{prefix}{key}.", path)
        _check_relations(part, prefix, path)
        _check_layer_lists(part, prefix, path)


def _rope_dicts(part: dict) -> list[tuple[str, dict]]:
    """rope_parameters and rope_scaling, or the per-layer-type dicts they hold (sliding/full)."""
    found = []
    for key in ROPE_KEYS:
        rope = part.get(key)
        if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
            found += [(f"{key}.{kind}", sub) for kind, sub in rope.items()]
        elif isinstance(rope, dict):
            found.append((key, rope))
    return found


def check_config_dims(config: dict, path: str | Path) -> None:
    """Walk config (nested dicts and lists) and raise BadInput at the first bad value."""
    max_items = max(MIN_LIST_ITEMS, LIST_ITEMS_PER_LAYER * _most_layers(config))
    for key, value in config.items():
        _check_value(value, _shown(key), key, path, 1, max_items)


def _most_layers(config: dict) -> int:
    """The largest layer count any part of the config states (0 when none does)."""
    counts = [part.get(key) for _, part in _parts(config) for key in LAYER_KEYS]
    return max((n for n in counts if type(n) is int and 0 < n <= WIDTH_LIMIT), default=0)


def _shown(key: object) -> str:
    """A key as it appears in a key path: an over-long one cut, so the one-line error stays short."""
    text = str(key)
    return text if len(text) <= 80 else f"{text[:40]}...({len(text)} characters)"


def _parts(config: dict) -> list[tuple[str, dict]]:
    parts = [("", config)]
    parts += [(f"{key}.", config[key]) for key in PART_KEYS if isinstance(config.get(key), dict)]
    return parts


def _check_value(value: object, key_path: str, key: str, path: str | Path, depth: int, max_items: int) -> None:
    if depth > MAX_DEPTH:
        raise BadInput(path, key_path, f"nested deeper than {MAX_DEPTH} levels; no real config is")
    if isinstance(key, str):
        _check_string(key, key_path, path, "key is ")
    if isinstance(value, dict):
        for child, child_value in value.items():
            _check_value(child_value, f"{key_path}.{_shown(child)}", child, path, depth + 1, max_items)
    elif isinstance(value, list):
        if len(value) > max_items:
            raise BadInput(path, key_path, f"a list of {len(value)} items; at most {max_items} for this "
                           "model's layer count, no real config holds more")
        # list items keep the list's key: patch_size [14, 14] is checked as sizes
        for i, item in enumerate(value):
            _check_value(item, f"{key_path}[{i}]", key, path, depth + 1, max_items)
    elif isinstance(value, float) and not math.isfinite(value):
        raise BadInput(path, key_path, f"must be a finite number, got {value}")
    elif isinstance(value, str):
        _check_string(value, key_path, path, "")
        # a size given as a string ("4") is still a size of the wrong type
        _check_named_size(value, key_path, key.lower(), path)
    elif value is not None:
        _check_named_size(value, key_path, key.lower(), path)


def _check_string(text: str, key_path: str, path: str | Path, what: str) -> None:
    if len(text) > MAX_STRING_CHARS:
        raise BadInput(path, key_path, f"{what}a string of {len(text)} characters; config strings are "
                       f"names and short values, at most {MAX_STRING_CHARS}")
    if _has_surrogate(text):
        raise BadInput(path, key_path, f"{what}not valid Unicode (lone surrogate escape)")


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and any(0xD800 <= ord(ch) <= 0xDFFF for ch in text)


def _check_named_size(value: object, key_path: str, key: str, path: str | Path) -> None:
    if key in CORE_KEYS:
        _check_int(value, key_path, 1, WIDTH_LIMIT, path)
    elif key in POSITION_KEYS:
        _check_number(value, key_path, POSITION_LIMIT, path)
    elif key.startswith(SIZE_PREFIXES) or key.endswith(SIZE_SUFFIXES) or key == "head_dim":
        _check_number(value, key_path, WIDTH_LIMIT, path)
    elif key in EPS_KEYS and not (_is_number(value) and 0 < value < 1):
        raise BadInput(path, key_path, f"must be a number in (0, 1), got {value!r:.40}")


def _is_number(value: object) -> bool:
    return type(value) in NUMBER


def _check_int(value: object, key_path: str, low: int, high: int, path: str | Path) -> None:
    # bool is a subclass of int in Python but never a size
    if type(value) is not int:
        raise BadInput(path, key_path, f"must be an integer, got {type(value).__name__} {value!r:.40}")
    if not low <= value <= high:
        raise BadInput(path, key_path, f"must be an integer in [{low}, {high}], got {value}")


def _check_number(value: object, key_path: str, high: int, path: str | Path) -> None:
    if not _is_number(value) and type(value) is not bool:
        raise BadInput(path, key_path, f"must be a number, got {type(value).__name__} {value!r:.40}")
    if type(value) is int:
        _check_int(value, key_path, -1, high, path)


def _check_key_types(part: dict, key_types: dict[str, tuple[type, ...]], prefix: str, path: str | Path) -> None:
    for key, types in key_types.items():
        value = part.get(key)
        if value is not None:
            _check_type(value, types, prefix + key, path)
        for i, item in enumerate(value if key in ITEM_TYPES and value is not None else ()):
            _check_type(item, ITEM_TYPES[key], f"{prefix}{key}[{i}]", path)


def _check_positive(part: dict, keys: tuple[str, ...], prefix: str, path: str | Path) -> None:
    # types were checked before: a number here, or null (the default)
    for key in keys:
        value = part.get(key)
        if _is_number(value) and not value > 0:
            raise BadInput(path, prefix + key, f"must be a number above 0, got {value}")


def _check_type(value: object, types: tuple[type, ...], key_path: str, path: str | Path) -> None:
    # bool is an int subclass: a flag is never a number here, a number never a flag
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = "a number" if types == NUMBER else " or ".join(_JSON_NAMES[t] for t in types)
        raise BadInput(path, key_path, f"must be {names}, got {_json_name(value)} {value!r:.40}")


_JSON_NAMES = {str: "a string", list: "a list", dict: "an object", int: "an integer", float: "a number",
               bool: "true or false"}


def _json_name(value: object) -> str:
    return {bool: "boolean", str: "string", list: "list", dict: "object", int: "integer", float: "number"}.get(
        type(value), type(value).__name__)


def _check_relations(part: dict, prefix: str, path: str | Path) -> None:
    """Fields that contradict each other; each is only judged when both sides are present."""
    experts, top_k = _first(part, EXPERT_KEYS), _first(part, TOP_K_KEYS)
    if _ints(experts, top_k) and top_k[1] > experts[1]:
        raise BadInput(path, prefix + top_k[0], f"routes to {top_k[1]} experts per token but "
                       f"{experts[0]} is {experts[1]}; must be at most that")
    heads, kv_heads = _first(part, ("num_attention_heads",)), _first(part, ("num_key_value_heads",))
    if _ints(heads, kv_heads) and heads[1] % kv_heads[1]:
        raise BadInput(path, prefix + "num_key_value_heads", f"{kv_heads[1]} must divide num_attention_heads ({heads[1]})")
    groups, topk_groups = _first(part, ("n_group", "num_expert_group")), _first(part, ("topk_group",))
    if _ints(groups, topk_groups) and topk_groups[1] > groups[1]:
        raise BadInput(path, prefix + "topk_group", f"{topk_groups[1]} groups picked of {groups[1]}; must be at most that")
    # rotary dim <= head dim, in language models only: EfficientLoFTR (image matching) uses the
    # same key for a factor of 4
    highest = 1 if "vocab_size" in part else math.inf
    for where, rope in [("", part), ("rope_parameters.", part.get("rope_parameters"))]:
        factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
        if factor is not None and not (_is_number(factor) and 0 < factor <= highest):
            raise BadInput(path, f"{prefix}{where}partial_rotary_factor",
                           f"the rotary fraction of each head must be in (0, {highest}], got {factor!r:.40}")


def _check_layer_lists(part: dict, prefix: str, path: str | Path) -> None:
    """Per-layer lists hold one entry per layer and layer indices name layers the model has: the file
    contradicts itself otherwise. Their item types were checked before (KEY_TYPES, ITEM_TYPES)."""
    layers = _first(part, LAYER_KEYS)
    if not _ints(layers):
        return
    for key in PER_LAYER_KEYS:
        value = part.get(key)
        if isinstance(value, list) and len(value) != layers[1]:
            raise BadInput(path, prefix + key, f"has {len(value)} entries but {layers[0]} is {layers[1]}; "
                           "one entry per layer")
    for key in LAYER_INDEX_KEYS:
        _check_layer_indices(part.get(key), prefix + key, layers, 0, path)
    linear = part.get("linear_attn_config")
    for key in ONE_BASED_INDEX_KEYS if isinstance(linear, dict) else ():
        _check_layer_indices(linear.get(key), f"{prefix}linear_attn_config.{key}", layers, 1, path)


def _check_layer_indices(value: object, key_path: str, layers: tuple[str, int], first: int, path: str | Path) -> None:
    """A list of layer indices numbered from `first`, each naming a layer the model has."""
    if value is None:
        return
    _check_type(value, (list,), key_path, path)
    for i, index in enumerate(value):
        _check_type(index, (int,), f"{key_path}[{i}]", path)
        if not first <= index < layers[1] + first:
            raise BadInput(path, f"{key_path}[{i}]", f"layer {index} does not exist: {layers[0]} is {layers[1]}, "
                           f"layers are numbered from {first}")


def _first(part: dict, keys: tuple[str, ...]) -> tuple[str, object] | None:
    for key in keys:
        if part.get(key) is not None:
            return key, part[key]
    return None


def _ints(*pairs) -> bool:
    """Every (key, value) present with a positive integer value (0 experts means no MoE)."""
    return all(pair is not None and type(pair[1]) is int and pair[1] >= 1 for pair in pairs)


def check_counts_against_tensors(config: dict, names: list[str], path: str | Path) -> None:
    """Layer and expert counts cannot exceed the tensors that hold them, so no work sized by them
    (per-layer specs, per-expert names) outgrows the manifest.

    Every layer and every expert of a real release has weights. Where experts are stored one by
    one (`experts.N.`), each of them has its own tensors (3 or more) in every MoE layer, and at
    least 1 layer in 12 is MoE in every such family: layers x experts <= 4 x tensors."""
    per_expert = PER_EXPERT_NAME.search("\n".join(names)) is not None
    for prefix, part in _parts(config):
        counts = {key: part[key] for key in (*LAYER_KEYS, *EXPERT_KEYS) if type(part.get(key)) is int}
        for key, value in counts.items():
            if value > len(names):
                raise BadInput(path, prefix + key, f"{value} exceeds the {len(names)} tensors of the release; "
                               "every layer and expert has weights")
        layers, experts = _first(counts, LAYER_KEYS), _first(counts, EXPERT_KEYS)
        if per_expert and layers and experts and layers[1] * experts[1] > 4 * len(names):
            raise BadInput(path, prefix + experts[0], f"{experts[1]} experts in {layers[1]} layers need more "
                           f"tensors than the release's {len(names)}, which stores its experts one by one")


def transformers_config(config: dict, path: str | Path):
    """The family's transformers config object built from a copy of config, or None for a family
    transformers does not know. Whatever that class refuses is bad input: it is the outer bound
    of what a release of the family may say."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if config.get("model_type") not in CONFIG_MAPPING_NAMES:
        return None
    values = {k: v for k, v in copy.deepcopy(config).items() if k != "transformers_version"}
    # floats JSON cannot hold ({"__float__": "Infinity"}), decoded as transformers does reading config.json
    values = PretrainedConfig._decode_special_floats(values)
    try:
        return AutoConfig.for_model(**values)
    # the class's own validation (strict dataclass fields, ValueError) and whatever it trips over
    except Exception as exc:  # noqa: BLE001
        text = str(exc).strip()
        field = re.search(r"field '([^']+)'", text)
        reason = text.splitlines()[-1].strip() if text else type(exc).__name__
        raise BadInput(path, field.group(1) if field else None,
                       f"refused by transformers' config class for {config['model_type']}: {reason[:200]}") from None
