"""Shrink any family's default config to a tiny one, by key-name rules alone (no family named).

Widths, head counts, ranks and expert counts are capped by what their key names say they are;
zeros and nulls stay (they switch features off), but a null experts-per-token beside an expert
count takes its cap (a router cannot run without it: the default leaves it to the release); per-layer lists are cut to a few layers that
still show every distinct layer pattern, and lists of layer indices are renumbered alike. What a
rule cannot judge is left as it was: the model build then says whether the result is consistent.
"""
from __future__ import annotations

import re

MAX_LAYERS = 4
VOCAB = 512
# (key pattern, cap) in order: the first pattern that matches a key decides its cap.
CAPS: list[tuple[str, int]] = [
    (r"^(num_)?(routed_|local_|moe_|n_routed_|n_)?experts$|^(moe_)?num_experts$|^n_routed_experts$|^num_local_experts$", 8),
    (r"experts_per_(tok|token)$|^moe_(k|topk)$|^top_?k$|^num_selected_experts$", 2),
    (r"shared_experts$|^zero_expert_num$", 1),
    (r"^(n_group|num_expert_group|n_groups|mamba_n_groups)$", 2),
    (r"^topk_group$", 1),
    (r"(rope|rotary)_head_dim$|^qk_rope_head_dim$", 8),
    # MLA: nope + rope = 16, the derived qk_head_dim's cap, as families relating the three expect
    (r"^qk_nope_head_dim$", 8),
    (r"head_dim$|^d_head$|_d_head$|^head_size$|^kv_channels$", 16),
    (r"num_(key_value|kv)_heads$|^n_kv_heads?$|^num_kv$", 2),
    (r"heads$|^n_head$|_n_heads$", 4),
    (r"lora_rank$|_rank$", 32),
    (r"(intermediate|ffn|ffn_hidden|expert_ffn_hidden|share_expert)_(size|dim)$|^ffn_dim$|intermediate_size", 32),
    (r"hidden_sizes?$|hidden_dim$|_channels$|^(d_model|n_embd|dim|embed_dim|output_dim|mlp_dim|output_channels|"
     r"projector_(input|output)_dim|vision_output_dim)$", 64),
    (r"state_size$|d_state$", 16),
    (r"^sliding_window$|^attention_window$|^window_size$", 8),
    (r"index_topk$", 16),
    (r"^(block_size|chunk_size|mamba_chunk_size)$", 16),
    (r"^(depth|vision_layers)$", 2),
    (r"^(first_k_dense_replace|num_dense_layers)$", 1),
    # layer periods and offsets, so a pattern repeating every 8 layers still shows in MAX_LAYERS
    (r"(_period|_freq|_interval|_step|every_n_layers|_group_size)$", MAX_LAYERS),
    (r"_offset$", MAX_LAYERS - 1),
]
# experts per token: a null here does not switch routing off, it is left for the release to set
TOP_K_RE = re.compile(r"experts_per_(tok|token)$")
WIDTH_KEY_RE = re.compile(r"dim|size|heads|rank")
LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
TOKEN_ID_RE = re.compile(r"(_token_id|_token_index|_id)$")


def cap_for(key: str) -> int | None:
    for pattern, cap in CAPS:
        if re.search(pattern, key.lower()):
            return cap
    return None


def shrink(config: dict) -> dict:
    """A tiny copy of config (a to_dict() of a transformers config, nested parts included)."""
    tokens = _TokenIds()
    return _shrink_part(config, tokens, top=True)


class _TokenIds:
    """Special-token ids above the tiny vocabulary get distinct ids from its top down."""

    def __init__(self):
        self.assigned: dict[int, int] = {}

    def remap(self, value: int) -> int:
        if value < VOCAB - 64:
            return value
        return self.assigned.setdefault(value, VOCAB - 1 - len(self.assigned))


def _shrink_part(part: dict, tokens: _TokenIds, top: bool = False) -> dict:
    out = {}
    keep = _layer_selection(part)
    for key, value in part.items():
        out[key] = _shrink_value(key, value, part, keep, tokens)
    out.update(_equal_widths_stay_equal(part, out))
    if keep is not None:
        out[_layer_count_key(part)] = len(keep)
    return out


def _shrink_value(key, value, part: dict, keep: list[int] | None, tokens: _TokenIds):
    key = str(key)  # id2label's keys are ints
    if isinstance(value, dict):
        return _shrink_part(value, tokens) if _looks_like_config(value) else _shrink_mapping(value, keep, part)
    if keep is not None and isinstance(value, list) and len(value) == _num_layers(part):
        return [value[i] for i in keep]
    if keep is not None and _is_layer_index_list(key, value, part):
        return [keep.index(i) for i in value if i in keep]
    if "section" in key and isinstance(value, list) and all(type(v) is int for v in value):
        return _scaled_sections(value, part)
    if isinstance(value, list) and value and all(type(v) is int and v > 0 for v in value) and cap_for(key):
        return [min(v, cap_for(key)) for v in value]
    if value is None and TOP_K_RE.search(key) and _expert_count(part):
        return cap_for(key)
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    if key.endswith("vocab_size"):
        return min(value, VOCAB)
    if TOKEN_ID_RE.search(key):
        return tokens.remap(value)
    cap = cap_for(key)
    return min(value, cap) if cap is not None and value > 0 else value


def _equal_widths_stay_equal(part: dict, small: dict) -> dict:
    """Widths equal in the default (head_dim == qk_rope_head_dim in MLA configs; head counts: kv heads ==
    heads) take the smallest of their shrunk values: families build one from the other."""
    groups: dict[tuple[int, bool], list[str]] = {}
    for key, value in part.items():
        if type(value) is int and value > 1 and WIDTH_KEY_RE.search(str(key)) and cap_for(str(key)):
            groups.setdefault((value, "heads" in str(key)), []).append(key)
    return {key: min(small[k] for k in keys) for keys in groups.values() if len(keys) > 1 for key in keys}


def _shrink_mapping(value: dict, keep, part: dict) -> dict:
    """Dicts that are not configs (rope parameters, per-layer settings): their widths shrink too; a dict
    keyed by layer index keeps the kept layers, renumbered."""
    if keep is not None and value and all(str(k).isdigit() for k in value):
        value = {str(keep.index(int(k))): v for k, v in value.items() if int(k) in keep}
    # relations (kv heads == heads) are judged within the mapping when it sets them itself
    local = {**part, **{k: v for k, v in value.items() if not isinstance(v, dict)}}
    small = {k: _shrink_value(k, v, local, keep, _TokenIds()) if not isinstance(v, dict)
             else _shrink_mapping(v, keep, local) for k, v in value.items()}
    return small | _equal_widths_stay_equal(value, small)


def _scaled_sections(sections: list[int], part: dict) -> list[int]:
    """Multimodal rope sections split the rotary pairs of a head: scaled with the head width."""
    key = next((k for k in ("qk_rope_head_dim", "head_dim") if type(part.get(k)) is int and part[k] > 0), None)
    if key is None or not sum(sections):
        return sections
    old = part[key]
    target = max(len(sections), round(sum(sections) * min(old, cap_for(key)) / old))
    scaled = [max(1, v * target // sum(sections)) for v in sections]
    scaled[0] += target - sum(scaled)
    return scaled


def _expert_count(part: dict) -> int:
    return max((v for k, v in part.items() if type(v) is int and re.search(CAPS[0][0], str(k).lower())), default=0)


def _first_int(part: dict, *keys: str) -> int | None:
    return next((part[k] for k in keys if type(part.get(k)) is int), None)


def _looks_like_config(value: dict) -> bool:
    return "model_type" in value or any(k in value for k in LAYER_COUNT_KEYS + ("hidden_size",))


def _layer_count_key(part: dict) -> str | None:
    return next((k for k in LAYER_COUNT_KEYS if isinstance(part.get(k), int) and part.get(k) > 0), None)


def _num_layers(part: dict) -> int:
    key = _layer_count_key(part)
    return part[key] if key else 0


def _is_layer_index_list(key: str, value, part: dict) -> bool:
    return ("layer" in key.lower() and isinstance(value, list) and value
            and all(type(i) is int and 0 <= i < _num_layers(part) for i in value))


def _layer_selection(part: dict) -> list[int] | None:
    """Layers kept: the first of each distinct per-layer pattern, then the earliest others, up to MAX_LAYERS."""
    total = _num_layers(part)
    if not total:
        return None
    # a list of all-distinct values (kv_source_layers = 0..L-1) is bookkeeping, not a layer pattern
    per_layer = [v for v in part.values() if isinstance(v, list) and len(v) == total and total > 1
                 and len({repr(x) for x in v}) < total]
    per_layer += [_membership(v, total) for k, v in part.items() if _is_layer_index_list(k, v, part)]
    seen, keep = set(), []
    for i in range(total):
        pattern = tuple(repr(v[i]) for v in per_layer)
        if pattern not in seen:
            seen.add(pattern)
            keep.append(i)
    for i in range(total):
        if len(keep) >= min(total, MAX_LAYERS):
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def _membership(indices: list[int], total: int) -> list[bool]:
    members = set(indices)
    return [i in members for i in range(total)]
