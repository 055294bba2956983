"""GapReport: each component of a ModelSpec against the operator registry, the weight check, the memory budget."""
from __future__ import annotations

import math
import re
from typing import Literal, Optional, get_args

from pydantic import BaseModel, field_validator

from onboard.gap.budget import MemoryBudget, budget, stored_as
from onboard.recognize.meta_check import MetaCheck, meta_check
from onboard.recognize.recognizer import LINEAR_ATTENTION_TENSORS, declared_activation
from onboard.recognize.weight_layout import expected_tensors
from onboard.release.manifest import Manifest
from onboard.release.model_source import model_entry
from onboard.release.key_kinds import generation_keys
from onboard.release.naming import outside_text, text_tensors
from onboard.recognize.experts import declared_routing, experts_per_layer
from onboard.release.transformers_classes import transformers_knows
from runtime import defaults
from runtime.ops.common.available import kernels_available
from runtime.registry import OPS, ops_for_layer
from runtime.spec import DenseFFN, ModelSpec, Unrecognized

# own: runs through the model's own module (transformers' class for the layer, or the release's code): trainable, slow
Status = Literal["covered", "variant", "generated", "own", "missing"]
STATUSES = get_args(Status)
# backward compatibility: gap reports written before `own` had its own word said `fallback`
OLD_STATUS = {"fallback": "own"}


class OpGap(BaseModel):
    op: str
    covers: str
    status: Status
    layers: list[int]
    runtime_op: Optional[str]
    kernel: Optional[str]
    reference_op: str
    detail: str = ""
    needs: Optional[Literal["llm", "person"]] = None  # who can close a missing op (set by the agents)
    evidence: Optional[dict] = None  # a generated op's validation, or why its candidates were refused

    @field_validator("status", mode="before")
    @classmethod
    def _old_status(cls, status):
        return OLD_STATUS.get(status, status) if isinstance(status, str) else status


class ShapeMismatch(BaseModel):
    name: str
    expected: list[int]
    actual: list[int]


class WeightCheck(BaseModel):
    shapes_checked: bool  # False when only the index is present (no headers to read shapes from)
    expected: int
    present: int
    # tensors under the vision prefix: loaded whole by the release's own vision tower, so not
    # matched name by name here; present + vision_tensors is every tensor of the release
    vision_tensors: int
    missing: list[str]
    unexpected: list[str]
    shape_mismatches: list[ShapeMismatch]


class KernelsHere(BaseModel):
    """Whether the fused kernels named in `ops` can run on this machine (the report is the same either way)."""
    available: bool
    reason: str


class GapReport(BaseModel):
    model: dict
    ops: list[OpGap]
    kernels: KernelsHere
    weights: WeightCheck
    memory: MemoryBudget
    meta_check: Optional[MetaCheck]  # transformers' own model on the meta device, when it knows the family
    unrecognized: list[Unrecognized]
    summary: dict

    @field_validator("summary", mode="before")
    @classmethod
    def _old_counts(cls, summary):
        # backward compatibility: the per-status counts of a gap report written before keyed `own` as `fallback`
        if isinstance(summary, dict) and isinstance(summary.get("ops"), dict):
            return {**summary, "ops": {OLD_STATUS.get(k, k): n for k, n in summary["ops"].items()}}
        return summary


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".N.", re.sub(r"\.\d+\.", ".N.", name))


def op_gaps(spec: ModelSpec, release_code: str | None = None) -> list[OpGap]:
    """release_code: the auto_map entry of the release's own model class (`modeling_x.Class`), when it ships one."""
    if spec.own_model:
        # transformers' model computes everything, no registry op runs
        return [_own_gap("model", [layer.index for layer in spec.layers], spec.own_model, True)]
    found: dict[tuple[str, str], set[int]] = {}
    own: dict[str, tuple[list[int], str]] = {}
    for layer in spec.layers:
        for name, part in [("rms_norm", spec.norm)] + ops_for_layer(layer.attention, layer.ffn, attn_res=spec.attn_res):
            support = OPS[name].supports(part)
            found.setdefault((name, support), set()).add(layer.index)
        for part, reason in _own_parts(layer):
            own.setdefault(part, ([], reason))[0].append(layer.index)
    knows = transformers_knows(spec.family)
    gaps = [_op_gap(name, support, sorted(layers), knows) for (name, support), layers in sorted(found.items())]
    return gaps + [_own_gap(name, layers, reason, knows, release_code) for name, (layers, reason) in sorted(own.items())]


def _own_parts(layer) -> list[tuple[str, str]]:
    """(part, reason) of what runs as its own module: the whole decoder layer, or its attention / FFN."""
    if layer.own_layer:
        return [("decoder_layer", layer.own_layer)]
    return [(part, module.reason) for part, module in (("attention", layer.attention), ("ffn", layer.ffn))
            if module.kind == "own_module"]


def _own_gap(part: str, layers: list[int], reason: str, knows: bool, release_code: str | None = None) -> OpGap:
    status = "own" if knows else "missing"
    detail = ("runs through the model's own transformers module (slow): " if knows
              else _unknown_family(release_code)) + reason
    return OpGap(op=f"own:{part}", covers=f"{part}:own_module", status=status, layers=layers, runtime_op=None,
                 kernel=None, reference_op="transformers" if knows else "-", detail=detail)


def _unknown_family(release_code: str | None) -> str:
    if release_code is None:
        return "not recognized and transformers does not know the family: "
    # the release's code is untrusted: confined it is only a reference, never a part of the model we train
    return (f"not recognized and transformers does not know the family; only the release's own code "
            f"({release_code.rsplit('.', 1)[0]}.py) builds it, and that code runs here only confined, as tiers 1-2's "
            "reference: as a module of the trained model it would run in your process, which needs "
            "--trust-remote-code (not offered yet): ")


def _op_gap(name: str, support: str, layers: list[int], knows: bool) -> OpGap:
    op = OPS[name]
    has_runtime = op.exists("torch_form")
    if support != "unsupported" and has_runtime:
        status = "covered" if support == "exact" else "variant"
        detail = "" if support == "exact" else "supported through a less exercised parameter path"
    elif support == "unsupported" and has_runtime:
        # the layer is built from this op, which cannot compute these parameters: nothing runs it
        status, detail = "missing", "the runtime op does not compute these parameters"
    elif knows:
        status, detail = "own", "runs through the model's own transformers module (slow)"
    else:
        status, detail = "missing", "no runtime op and no own module of the model to run instead"
    return OpGap(op=name, covers=op.covers, status=status, layers=layers,
                 runtime_op=op.torch_form if status in ("covered", "variant") else None,
                 kernel=op.kernel if status in ("covered", "variant") and op.exists("kernel") else None,
                 reference_op=op.reference, detail=detail)


def check_weights(spec: ModelSpec, manifest: Manifest) -> WeightCheck:
    """Expected tensors vs the release (recognize_weights has turned disagreements inside layers into
    own modules, so mismatches left here are outside them: a gap, like missing tensors)."""
    expected = expected_tensors(spec)
    present = text_tensors(manifest, spec.naming)
    if spec.own_model:
        # transformers' model loads every tensor by name; its meta model checked their shapes (recognize_weights)
        expected = {n: tuple(t.shape or ()) for n, t in present.items()}
    mismatches = [ShapeMismatch(name=n, expected=list(shape), actual=list(present[n].shape))
                  for n, shape in expected.items()
                  if n in present and present[n].shape is not None and tuple(present[n].shape) != shape]
    return WeightCheck(shapes_checked=manifest.shards_present, expected=len(expected), present=len(present),
                       vision_tensors=len(manifest.tensors) - len(present),
                       missing=sorted(n for n in expected if n not in present),
                       unexpected=sorted(n for n in present if n not in expected), shape_mismatches=mismatches)


def unexpected_as_unrecognized(unexpected: list[str]) -> list[Unrecognized]:
    patterns: dict[str, int] = {}
    for name in unexpected:
        patterns[_pattern(name)] = patterns.get(_pattern(name), 0) + 1
    return [Unrecognized(source=f"weights:{p}", item=p, detail=f"{n} tensor(s) no recognized component uses")
            for p, n in sorted(patterns.items())]


def analyze(spec: ModelSpec, manifest: Manifest, gpu_mem_gib: float = defaults.GPU_MEM_GIB,
            lora_rank: int = defaults.LORA_RANK, seq_len: int = defaults.SEQ_LEN) -> GapReport:
    ops = op_gaps(spec, model_entry(manifest.config))
    weights = check_weights(spec, manifest)
    meta = meta_check(spec, manifest) if transformers_knows(spec.family) else None
    available, reason = kernels_available()
    return GapReport(model=model_summary(spec, manifest), ops=ops, kernels=KernelsHere(available=available, reason=reason),
                     weights=weights,
                     memory=budget(spec, gpu_mem_gib, lora_rank, seq_len), meta_check=meta,
                     unrecognized=list(spec.unrecognized) + unexpected_as_unrecognized(weights.unexpected),
                     summary=summarize(ops, weights, meta))


def summarize(ops: list[OpGap], weights: WeightCheck, meta: Optional[MetaCheck]) -> dict:
    counts = {s: sum(1 for o in ops if o.status == s) for s in STATUSES}
    # a tensor nothing uses may change the computation: not understood, so not ready
    gaps = counts["missing"] > 0 or bool(weights.missing or weights.unexpected or weights.shape_mismatches)
    return {"ops": counts, "gaps_remain": gaps, "meta_check_agrees": meta.agrees if meta else None}


def model_summary(spec: ModelSpec, manifest: Manifest) -> dict:
    kinds: dict[str, list[int]] = {}
    for layer, kind in zip(spec.layers, spec.layer_kinds()):
        kinds.setdefault(kind, []).append(layer.index)
    moe = [layer.ffn for layer in spec.layers if layer.ffn.kind == "moe"]
    first = moe[0] if moe else None
    experts = experts_per_layer(spec)
    # MoE layers run as own modules: their experts counted from their tensors, routing as the config declares it
    top_k, shared = (first.top_k, first.num_shared_experts) if first else declared_routing(manifest) if experts else (0, 0)
    return {
        "source": str(manifest.root), "family": spec.family, "architecture": spec.architecture,
        "num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size,
        "layer_kinds": {k: len(v) for k, v in kinds.items()}, "layers_by_kind": kinds,
        "attention_kinds": _attention_counts(spec),
        "num_experts": max(experts.values(), default=0), "top_k": top_k, "num_shared_experts": shared,
        "moe_layers": len(experts), "moe_layers_own": len(experts) - len(moe),
        "vision": spec.vision.model_dump() if spec.vision else None, "vision_not_supported": _vision_gap(spec),
        "generation_keys": generation_keys(manifest.config, _text_key(manifest)),
        "activation": activation_summary(manifest.text_config, spec),
        "params_total": spec.params.total, "params_active": spec.params.active,
        "manifest_params": manifest.total_params, "params_other_towers": _other_tower_params(spec, manifest),
        "params": spec.params.model_dump(), "spec_hash": spec.spec_hash(),
        # the formats the base ships in per tensor group ("" for a bf16/fp32 release); the counts above are logical
        "stored_as": stored_as(spec),
    }


def activation_summary(text_config: dict, spec: ModelSpec | None = None) -> dict:
    """The FFNs' activation as the config names it, its parameters, and whether the runtime's FFN ops compute it
    (built in, or generated by this package), judged on a recognized FFN of the spec where there is one: it carries
    the activation's parameters (SiTU-GLU's betas)."""
    name, params = declared_activation(text_config)
    ffns = [layer.ffn for layer in (spec.layers if spec else []) if layer.ffn.kind in ("dense", "moe")]
    part = ffns[0] if ffns and ffns[0].activation == name else DenseFFN(intermediate_size=1, activation=name)
    computed = OPS["swiglu_mlp"].supports(part) != "unsupported"
    return {"name": name, "parameters": params, "computed": computed}


def _vision_gap(spec: ModelSpec) -> Optional[str]:
    """Why a vision tower the release has is not supported (the recognizer's note), None when there is none."""
    return next((u.detail for u in spec.unrecognized if u.item == "vision tower not understood"), None)


def _text_key(manifest: Manifest) -> Optional[str]:
    return next((k for k, v in manifest.config.items() if v is manifest.text_config), None)


def _attention_counts(spec: ModelSpec) -> dict[str, int]:
    """Linear vs softmax-style counts: gated_delta/kda/lightning are linear; MLA with an indexer is sparse. An
    attention run as its own module counts as linear when its tensors are a linear attention's (a decay, short
    convolutions), as recognition judged it."""
    counts = {"linear": 0, "sparse": 0, "full": 0, "sliding": 0}
    for layer in spec.layers:
        a = layer.attention
        if a.kind in ("gated_delta", "kda", "lightning") or _linear_own(a):
            counts["linear"] += 1
        elif a.kind == "mla" and a.indexer is not None:
            counts["sparse"] += 1
        elif a.kind == "softmax" and a.sliding_window:
            counts["sliding"] += 1
        else:
            counts["full"] += 1
    return counts


def _other_tower_params(spec: ModelSpec, manifest: Manifest) -> Optional[int]:
    """Parameters of the tensors outside the text model (vision tower, projector); None when shapes are unknown."""
    names = outside_text(manifest.tensors, spec.naming)
    shapes = [manifest.tensors[n].shape for n in names]
    return sum(math.prod(s) for s in shapes) if all(s is not None for s in shapes) else None


def _linear_own(attention) -> bool:
    return attention.kind == "own_module" and any(re.search(LINEAR_ATTENTION_TENSORS, n) for n in attention.tensors)
