"""How a release names its tensors (runtime/spec.py's WeightNaming, a field of the spec): detected here from the
weight names, then used to list the expected tensors."""
from __future__ import annotations

import re
from typing import Optional

from runtime.spec import WeightNaming

EXPERT_INDEX_RE = re.compile(r"\.\d+\.")


def scan_layers(names) -> tuple[str, dict[int, set[str]]]:
    """(text decoder prefix, {layer index: {name after 'layers.N.' with expert indices collapsed to N}}).

    One pass of string slicing, no regex per name: the flagship index holds 157k names, 150k of them
    experts, which collapse to a handful of patterns per layer.
    """
    names = list(names)
    prefixes: dict[str, int] = {}
    by_prefix: dict[str, dict[int, set[str]]] = {}
    for name in names:
        start = name.find("layers.")
        if start < 0 or "vis" in name[:start]:
            continue
        end = name.find(".", start + 7)
        index = name[start + 7:end]
        if not index.isdigit():
            continue
        prefix, rest = name[:start], name[end + 1:]
        prefixes[prefix] = prefixes.get(prefix, 0) + 1
        if "experts." in rest:
            rest = EXPERT_INDEX_RE.sub(".N.", rest)
        by_prefix.setdefault(prefix, {}).setdefault(int(index), set()).add(rest)
    if not prefixes:
        return "model.", {}
    prefix = max(prefixes, key=lambda p: (_holds_embedding(names, p), prefixes[p]))
    return prefix, by_prefix[prefix]


def text_root(prefix: str) -> str:
    """The text model's own root when its decoder sits at `<root>.model.` (a multimodal release's
    `language_model.model.`): its head is `<root>.lm_head`, and tensors outside the root belong to other towers
    (vision, projector). '' when the decoder prefix is not of that form (`model.`, `model.language_model.`)."""
    parts = prefix.rstrip(".").split(".")
    return ".".join(parts[:-1]) + "." if len(parts) > 1 and parts[-1] == "model" else ""


def head_name(naming: WeightNaming) -> str:
    """The released name of the untied LM head."""
    return f"{text_root(naming.prefix)}lm_head.weight"


def outside_text(names, naming: WeightNaming) -> list[str]:
    """Tensors of other towers: under the vision prefix, or outside the text model's root when it has one."""
    root, vision = text_root(naming.prefix), naming.vision_prefix or "\0"
    return [n for n in names if n.startswith(vision) or (root and not n.startswith(root))]


def text_tensors(manifest, naming: WeightNaming) -> dict:
    """The manifest's tensors of the text model: all but those of other towers (outside_text)."""
    other = set(outside_text(manifest.tensors, naming))
    return {n: t for n, t in manifest.tensors.items() if n not in other}


def _holds_embedding(names, prefix: str) -> bool:
    """Whether a token embedding sits beside the layers under prefix: the text decoder's, where another
    tower's layers (an audio encoder's) may be more."""
    return any(n.startswith(prefix) and "embed" in n[len(prefix):] and n.count(".") == prefix.count(".") + 1
               for n in names)


def _first_component_with(suffixes, leaf_pattern: str) -> Optional[str]:
    pattern = re.compile(rf"^([a-z_]+)\.{leaf_pattern}")
    for s in sorted(suffixes):
        m = pattern.match(s)
        if m:
            return m.group(1)
    return None


def detect_naming(names, scan: tuple[str, dict[int, set[str]]] | None = None) -> WeightNaming:
    """Detect module names and layouts from the full list of tensor names (and its scan_layers, if made)."""
    prefix, by_layer = scan or scan_layers(names)
    all_suffixes = set().union(*by_layer.values()) if by_layer else set()
    kw: dict = {"prefix": prefix}
    softmax = _first_component_with(all_suffixes, r"(q_proj|q_a_proj|qkv_proj)\.weight")
    linear = _first_component_with(all_suffixes, r"(in_proj_qkvz|in_proj_qkv|f_a_proj|forget_gate|qkv_proj)")
    ffn = _first_component_with(all_suffixes, r"(experts|gate\.weight|router\.weight|down_proj\.weight)")
    if softmax:
        kw["softmax_module"] = softmax
    if linear:
        kw["linear_module"] = linear
    if ffn:
        kw["ffn_module"] = ffn
    kw.update(_detect_moe_naming(all_suffixes))
    if any(".forget_gate.f_a_proj" in s for s in all_suffixes):
        kw["kda_gate_prefix"] = "forget_gate."
    kw["final_norm"], kw["embedding"] = _top_level(names, prefix, True), _top_level(names, prefix, False)
    vision = sorted({n.split("blocks.")[0] for n in names if ("visual." in n or "vision" in n) and "blocks." in n})
    kw["vision_prefix"] = vision[0] if vision else None
    return WeightNaming(**kw)


def _top_level(names, prefix: str, norm: bool) -> str:
    """The one norm (norm=True) or the one other weight directly under the decoder prefix: the final norm
    and the embedding. The usual name when there is none or several."""
    found = {n[len(prefix):-len(".weight")] for n in names if n.startswith(prefix) and n.endswith(".weight")
             and "." not in n[len(prefix):-len(".weight")]}
    found = {f for f in found if f.endswith("norm") == norm}
    return found.pop() if len(found) == 1 else ("norm" if norm else "embed_tokens")


def _detect_moe_naming(suffixes: set[str]) -> dict:
    kw: dict = {}
    if any(s.endswith(".experts.N.w1.weight") for s in suffixes):
        kw["expert_style"] = "w1_w3_w2"
    elif any(s.endswith(".experts.gate_up_proj") for s in suffixes):
        kw["expert_style"] = "fused_gate_up"
    if any(re.search(r"\.router\.weight$", s) for s in suffixes):
        kw["router_module"] = "router"
    for s in suffixes:
        m = re.search(r"^[a-z_]+\.((?:gate|moe_statics)\.e_score_correction_bias)$", s)
        if m:
            kw["correction_bias"] = m.group(1)
    if any(re.search(r"\.shared_expert\.", s) for s in suffixes):
        kw["shared_module"] = "shared_expert"
    return kw
