"""The weights' word on a recognized spec: components whose tensors we do not understand run as own modules.

Where transformers knows the family, its model built on the meta device (in the released tensor
format, as save_pretrained writes it) is the oracle: a release tensor whose shape differs from it
contradicts the release's own config (bad input); anything else the recognized spec does not
expect (a tensor of another shape or layout, a tensor no recognized component uses, one we would use
that the oracle does not read, one we expect that neither has) is our assumption failing, so the component holding
it becomes an OwnModule (the whole decoder layer when the tensor sits on the layer itself). A tensor
outside the layers not understood (another embedding or head, hyper-connection or extra norm parameters
of the model's own glue) makes the whole model transformers' own (`own_model`), when transformers knows it.
"""
from __future__ import annotations

import re
from typing import Optional

from onboard.errors import BadInput
from onboard.release.manifest import Manifest
from onboard.release.naming import text_tensors
from onboard.recognize.meta_check import (glue_reshapes, transformers_attention_linears, transformers_decoder_layers,
                                transformers_parameter_names, transformers_reshaped, transformers_tensors)
from onboard.recognize.weight_layout import expected_tensors
from runtime.spec import LayerSpec, ModelSpec, OwnModule, Unrecognized

LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
INDEX_RE = re.compile(r"\.\d+\.")


def _where(name: str, spec: ModelSpec) -> Optional[tuple[int, str]]:
    """(layer index, "attention" | "ffn" | "norm" | "layer") of a release tensor; None outside the layers."""
    head = f"{spec.naming.prefix}layers."
    if not name.startswith(head):
        return None
    index, _, rest = name[len(head):].partition(".")
    if not index.isdigit() or int(index) >= spec.num_layers:
        return None
    module = rest.split(".")[0]
    # `mlp`: the dense layers' FFN where the MoE layers' has another name (Kimi's block_sparse_moe)
    if module in (spec.naming.ffn_module, "mlp"):
        return int(index), "ffn"
    if module in LAYER_NORMS:
        return int(index), "norm"
    if module in (spec.naming.softmax_module, spec.naming.linear_module):
        return int(index), "attention"
    return int(index), "layer"


def _contradictions(manifest: Manifest, present: dict, oracle: dict, family: str) -> None:
    bad = [n for n, info in present.items() if n in oracle and info.shape is not None and tuple(info.shape) != oracle[n]]
    if bad:
        first = present[bad[0]]
        raise BadInput(manifest.root / (first.file or ""), bad[0],
                           f"shape {tuple(first.shape)} contradicts config.json, which implies {oracle[bad[0]]} "
                           f"in transformers' {family} model ({len(bad)} tensor(s) disagree)")


def _disagreements(spec: ModelSpec, present: dict, oracle: Optional[dict], complete: bool) -> dict:
    """(layer, part) -> why the recognized spec does not account for the release there."""
    expected, why = expected_tensors(spec), {}
    for name, info in present.items():
        reason = _disagreement(name, info, expected, oracle)
        # where the tensor sits is looked up only for a disagreement: most of a release's names agree
        where = None if reason is None else _where(name, spec)
        if where is not None:
            why.setdefault(where, reason)
    if oracle is not None and complete:
        for name in expected.keys() - present.keys() - oracle.keys():
            where = _where(name, spec)
            if where is not None:
                why.setdefault(where, f"recognized a tensor {name} that neither the release nor transformers has")
    return why


def _disagreement(name: str, info, expected: dict, oracle: Optional[dict]) -> Optional[str]:
    if name not in expected:
        return f"tensor {INDEX_RE.sub('.N.', name)} not understood"
    if oracle is not None and name not in oracle:
        # we would compute with a tensor the family's own model does not read
        return f"tensor {INDEX_RE.sub('.N.', name)} is not read by transformers' model"
    if info.shape is not None and tuple(info.shape) != expected[name]:
        return f"{name} stored as {tuple(info.shape)}, recognized as {expected[name]}"
    return None


def _outside_layers(spec: ModelSpec, present: dict, oracle: dict) -> Optional[str]:
    """Why the model's glue (embedding, final norm, head, anything between the layers) is not understood:
    the first release tensor outside the layers that transformers' model reads and the recognized spec does
    not expect; None if none. (A tensor neither reads stays a gap: nothing would compute with it.)"""
    expected = expected_tensors(spec)
    unknown = sorted(n for n in present if n in oracle and n not in expected and _where(n, spec) is None)
    return f"tensor {INDEX_RE.sub('.N.', unknown[0])} outside the layers not understood" if unknown else None


class _Names:
    """What transformers calls the release's tensors (its model of the release is the oracle): a tensor's name
    inside its decoder layer, and whether its module is an attention's nn.Linear (what LoRA adapts by default).
    Identity without an oracle."""

    def __init__(self, manifest: Manifest, names: list[str], known: bool):
        self.hf = transformers_parameter_names(manifest, names) if known else {}
        self.reshaped = transformers_reshaped(manifest, names) if known else set()
        self.linears = transformers_attention_linears(manifest) if known else set()
        self.decoder_layers = transformers_decoder_layers(manifest) if known else "layers"

    def decoder_linears(self, present: dict, index: int) -> list[str]:
        """Released modules in text layer `index` of transformers' model that are attention nn.Linear: found by
        their transformers names, so whatever the release calls its layers (a model run whole as its own)."""
        head = f"{self.decoder_layers}.{index}."
        return sorted(n.removesuffix(".weight") for n in present if n.endswith(".weight") and n not in self.reshaped
                      and (hf := self.hf.get(n, n)).startswith(head) and hf.removesuffix(".weight") in self.linears)

    def in_layer(self, name: str, index: int) -> str:
        return self.hf.get(name, name).partition(f"layers.{index}.")[2]

    def part(self, reason: str, tensors: dict, index: int, path: str = "") -> OwnModule:
        inner = {n: self.in_layer(n, index).removeprefix(f"{path}." if path else "") for n in tensors}
        linears = sorted(n.removesuffix(".weight") for n in tensors if n.endswith(".weight") and n not in self.reshaped
                         and self.hf.get(n, n).removesuffix(".weight") in self.linears)
        return OwnModule(reason=reason, path=path, tensors=tensors, inner=inner, linears=linears,
                         reshaped=sorted(self.reshaped & set(tensors)))


def _own(layer: LayerSpec, parts: dict[str, str], spec: ModelSpec, present: dict, names: _Names) -> LayerSpec:
    """The layer with the parts named in `parts` as own modules (all of it when its own tensors disagree);
    module paths are transformers' (after its checkpoint renamings), where the runtime finds the modules."""
    found: dict[str, dict[str, list[int]]] = {"attention": {}, "ffn": {}, "norm": {}, "layer": {}}
    for name, info in present.items():
        where = _where(name, spec)
        if where is not None and where[0] == layer.index:
            found[where[1]][name] = list(info.shape) if info.shape is not None else []
    i = layer.index
    paths = {names.in_layer(n, i).split(".")[0] for n in found["attention"]}
    whole = parts.get("layer") or parts.get("norm")
    if whole is None and "attention" in parts and len(paths) != 1:
        whole = parts["attention"]  # attention not under one module: only the layer as a whole is known
    if whole:
        rest = {**found["attention"], **found["norm"], **found["layer"]}
        return layer.model_copy(update={"own_layer": whole, "attention": names.part(whole, rest, i),
                                        "ffn": names.part(whole, found["ffn"], i)})
    fields = {}
    if "attention" in parts:
        reason = _first_reason(layer.attention, parts["attention"])
        fields["attention"] = names.part(reason, found["attention"], i, paths.pop())
    if "ffn" in parts:
        ffn_paths = sorted({names.in_layer(n, i).split(".")[0] for n in found["ffn"]}) or [spec.naming.ffn_module]
        fields["ffn"] = names.part(_first_reason(layer.ffn, parts["ffn"]), found["ffn"], i, ffn_paths[0])
    return layer.model_copy(update=fields)


def _with_linears(layer: LayerSpec, linears: list[str]) -> LayerSpec:
    return layer.model_copy(update={"attention": layer.attention.model_copy(update={"linears": linears})})


def _first_reason(part, weights_reason: str) -> str:
    """A part the config rules already gave up on keeps their reason (the cause; the weights follow from it)."""
    return part.reason if part.kind == "own_module" else weights_reason


def _notes(why: dict) -> list[Unrecognized]:
    """One entry per (part, reason) pattern, naming the layers it holds for."""
    layers: dict[tuple[str, str], list[int]] = {}
    for (index, part), reason in sorted(why.items()):
        layers.setdefault((part, INDEX_RE.sub(".N.", reason)), []).append(index)
    return [Unrecognized(source=f"weights:layers {','.join(map(str, idx))}", item=f"{part} not understood", detail=reason)
            for (part, reason), idx in layers.items()]


def apply(spec: ModelSpec, manifest: Manifest) -> ModelSpec:
    """The spec with every component the weights contradict turned into an OwnModule."""
    present = text_tensors(manifest, spec.naming)
    oracle = transformers_tensors(manifest)
    if oracle is not None:
        _contradictions(manifest, present, oracle, spec.family)
    why = _disagreements(spec, present, oracle, manifest.shards_present)
    outside = (_outside_layers(spec, present, oracle) or glue_reshapes(manifest)) if oracle is not None else None
    if outside is not None:
        why = {**why, **{(layer.index, "layer"): f"the whole model runs as its own: {outside}" for layer in spec.layers}}
        spec = spec.model_copy(update={"own_model": outside})
    if not why:
        return spec
    spec = spec.model_copy(update={"unrecognized": list(spec.unrecognized) + _notes(why)})
    return run_own(spec, manifest, why, knows=oracle is not None)


def run_own(spec: ModelSpec, manifest: Manifest, why: dict[tuple[int, str], str], knows: bool = True) -> ModelSpec:
    """The spec with each (layer index, part) of `why` run as its own module, `why` the reason; part "layer" or
    "norm" makes the whole decoder layer its own. `knows`: transformers knows the family (its names are used)."""
    from onboard.recognize import param_count

    present = text_tensors(manifest, spec.naming)
    by_layer: dict[int, dict[str, str]] = {}
    for (index, part), reason in why.items():
        by_layer.setdefault(index, {})[part] = reason
    outside = spec.own_model is not None
    # a model run whole as its own may name its layers otherwise: all its tensors are looked up
    named = list(present) if outside else [n for n in present if (_where(n, spec) or (None,))[0] in by_layer]
    names = _Names(manifest, named, knows)
    layers = [_own(l, by_layer[l.index], spec, present, names) if l.index in by_layer else l for l in spec.layers]
    if outside:
        layers = [_with_linears(layer, names.decoder_linears(present, layer.index)) for layer in layers]
    from onboard.recognize.stored import with_stored

    spec = spec.model_copy(update={"layers": layers})
    return with_stored(spec.model_copy(update={"params": param_count.count(spec, spec.vision)}), manifest)
