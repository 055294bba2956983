"""Released tensor name -> runtime parameter name, with the steps that turn one into the other.

Entries are plain dicts (written to the package's weight_map.json, read by runtime/model/weights.py):
  {"target": "layers.3.ffn.experts.w_gate_up", "expert": 7, "rows": [0, 512], "transpose": false, "flatten": false}
`expert` writes into one slice of a stacked [E, ...] tensor, `rows` into a row range of it (gate and
up halves of w_gate_up), `transpose` swaps the last two dims (gpt-oss stores experts as [E, in, out]),
`flatten` drops singleton dims (Ernie's [1, E] correction bias). Tensors of a component that runs
as its own module have no target but `own_module` (the runtime tensor transformers loads them into);
tensors nothing reads (listed in the gap report) have neither.

A release that ships quantized weights is keyed by its logical names (onboard/release/manifest.py); an entry whose
weight is stored quantized carries `stored` (runtime/formats/scheme.py StoredEntry: format, codes and scale
tensors). The runtime keeps such a weight in the (out, in) orientation of its codes, so `transpose` is false on it
(gpt-oss's blocks are [E, out, in] already); `expert` and `rows` count rows of the logical weight, and an FP8
weight's scale rows are those rows over the block's: a row range off the block grid cannot be split (a gap).
"""
from __future__ import annotations

import re

from onboard.recognize.weight_layout import attention_tensors, ffn_tensors
from onboard.release.config_view import NotRecognized
from runtime.formats.scheme import FP8Block, StoredEntry
from onboard.release.naming import head_name
from runtime.spec import ModelSpec, MoEFFN

# the runtime module holding transformers' whole model, when the model runs as its own
OWN_MODEL = "own.module"
EXPERT_RE = re.compile(r"^experts\.(\d+)\.(\w+)\.weight$")
GATE_NAMES, UP_NAMES, DOWN_NAMES = ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")


def _entry(target: str, **steps) -> dict:
    return {"target": target, "expert": None, "rows": None, "transpose": False, "flatten": False, "own_module": None,
            **steps}


def build_weight_map(spec: ModelSpec, unused: list[str] = (), own_names: dict[str, str] | None = None,
                     stored: dict[str, StoredEntry] | None = None) -> dict[str, dict]:
    """`unused`: release tensors no runtime part reads (the gap report lists them); mapped to nothing.
    `own_names` (a model run whole as transformers' own): released name -> transformers' name of every tensor
    (None for one its conversion splits or fuses). `stored`: logical name -> its codes and scales, for every
    weight the release stores quantized (the manifest's `stored`)."""
    if spec.own_model:
        entries = {name: _entry(None, own_module=param and f"{OWN_MODEL}.{param}") for name, param in own_names.items()}
    else:
        entries = {name: _entry(None) for name in unused} | _mapped(spec)
    return {name: _stored_entry(name, entry, stored[name]) if stored and name in stored else entry
            for name, entry in entries.items()}


def _stored_entry(name: str, entry: dict, stored: StoredEntry) -> dict:
    rows = entry["rows"]
    if rows is not None and isinstance(stored.format, FP8Block) and any(r % stored.format.block[0] for r in rows):
        raise NotRecognized("quantization_config.weight_block_size", f"{name} fills rows {rows[0]}:{rows[1]} of "
                            f"{entry['target']}, off the {stored.format.block[0]}-row blocks its FP8 scales cover; "
                            "a scale block split between two weights is not supported yet")
    return {**entry, "transpose": False, "stored": stored.model_dump(mode="json")}


def _mapped(spec: ModelSpec) -> dict[str, dict]:
    n, d = spec.naming, spec.hidden_size
    out = {f"{n.prefix}{n.embedding}.weight": _entry("embed_tokens.weight"), f"{n.prefix}{n.final_norm}.weight": _entry("norm.weight")}
    if not spec.tie_word_embeddings:
        out[head_name(n)] = _entry("lm_head.weight")
    for layer in spec.layers:
        out |= _own_module_entries(layer, n.prefix)
        if layer.own_layer:
            continue
        src, dst = f"{n.prefix}layers.{layer.index}.", f"layers.{layer.index}."
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[src + norm] = _entry(dst + norm)
        attn_module = n.softmax_module if layer.attention.kind in ("softmax", "mla") else n.linear_module
        for leaf in attention_tensors(layer.attention, d, n):
            out[f"{src}{attn_module}.{leaf}"] = _entry(f"{dst}attn.{leaf.removeprefix(n.kda_gate_prefix)}")
        for leaf in ffn_tensors(layer.ffn, d, n):
            out[f"{src}{n.ffn_module}.{leaf}"] = _ffn_entry(leaf, layer.ffn, spec, dst + "ffn.")
    return out


def _own_module_entries(layer, prefix: str) -> dict[str, dict]:
    """Tensors of own modules are loaded by transformers into the module itself, by their released names;
    `own_module` names the runtime tensor they become (LoRA targets are found through it)."""
    head = f"{prefix}layers.{layer.index}."
    entries = {}
    for slot, part in (("attn", layer.attention), ("ffn", layer.ffn)):
        if part.kind != "own_module":
            continue
        # an own layer is the runtime layer's `own` slot; a tensor sits in its slot under its transformers name
        slot = "own" if layer.own_layer else slot
        inside = head + (f"{part.path}." if part.path else "")
        for name in part.tensors:
            inner = part.inner.get(name, name.removeprefix(inside))
            # a tensor transformers splits or fuses on loading becomes no one runtime tensor
            own = None if name in part.reshaped else f"layers.{layer.index}.{slot}.module.{inner}"
            entries[name] = _entry(None, own_module=own)
    return entries


def _ffn_entry(leaf: str, ffn, spec: ModelSpec, dst: str) -> dict:
    if not isinstance(ffn, MoEFFN):
        return _entry(dst + leaf)
    n, width = spec.naming, ffn.expert_intermediate_size
    m = EXPERT_RE.match(leaf)
    if m:
        expert, proj = int(m.group(1)), m.group(2)
        if proj in DOWN_NAMES:
            return _entry(dst + "experts.w_down", expert=expert)
        rows = [0, width] if proj in GATE_NAMES else [width, 2 * width]
        return _entry(dst + "experts.w_gate_up", expert=expert, rows=rows)
    fused = {"experts.gate_up_proj": ("experts.w_gate_up", True), "experts.down_proj": ("experts.w_down", True),
             "experts.gate_up_proj_bias": ("experts.b_gate_up", False), "experts.down_proj_bias": ("experts.b_down", False)}
    if leaf in fused:
        target, transpose = fused[leaf]
        return _entry(dst + target, transpose=transpose)
    if leaf == f"{n.router_module}.weight" or leaf == f"{n.router_module}.bias":
        return _entry(dst + "router." + leaf.rsplit(".", 1)[1])
    if n.correction_bias and leaf == n.correction_bias:
        return _entry(dst + "router.correction_bias", flatten=True)
    if leaf.startswith(n.shared_module + "."):
        return _entry(dst + "shared." + leaf.removeprefix(n.shared_module + "."))
    if leaf == "shared_expert_gate.weight":
        return _entry(dst + "shared_gate.weight")
    raise ValueError(f"no runtime home for FFN tensor {leaf!r}")
