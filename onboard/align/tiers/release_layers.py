"""Tier 1 against the release's own code (a release that ships it: onboard/align/release_code.py): the sandboxed
worker reruns each distinct layer of the release's model on the input its model fed it, forward and backward with
tier 1's cotangent; our layer runs here on the same input with the same cotangent. Output, input gradient and the
LoRA-target gradients are compared as tier 1 compares them with transformers' layer."""
from __future__ import annotations

from pathlib import Path

import torch

from onboard.align.progress import Progress
from onboard.align.reference import load_runtime, random_tokens
from onboard.align.release_code import ReferenceFailed, SandboxedReference, Task, expect, require_runnable_here
from onboard.align.report import Check, with_scales
from onboard.align.stored import scales_read
from onboard.align.tiers.layer_grads import LORA_TARGETS, cotangent, own_or_ours
from runtime.model.rotary import RotaryCache
from runtime.spec import ModelSpec
from runtime.tolerances import compare, tolerance_for

TAG = "tier1"


def release_layer_checks(spec: ModelSpec, weight_map: dict, source: Path, num_layers: int, layers: dict[str, int],
                         T: int, seed: int, progress: Progress | None = None,
                         reference: SandboxedReference | None = None) -> list[Check]:
    progress = progress or Progress()
    reference = reference or SandboxedReference(source, num_layers)
    task = Task(kind="layers", tag=TAG, dtype="float32", ids="ids", layers=tuple(layers.values()), seed=seed)
    truth, info = reference.run([task], {"ids": random_tokens(spec, 1, T, seed)})
    ran = [i for i in layers.values() if f"{TAG}/{i}/out" in truth]
    require_runnable_here(spec, f"reran layers {ran} forward and backward" if ran else "no layer reran alone: none takes "
                                "hidden states")
    ours = load_runtime(spec, weight_map, source, torch.float32, num_layers)
    if ours.own is not None:
        raise ReferenceFailed("our model runs whole as transformers' own model: its layers take transformers' "
                              "arguments, which the release's code does not hand over")
    rotary = RotaryCache(torch.arange(T)[None])
    checks = []
    for label, i in layers.items():
        progress.group(f"layer {i} ({label})")
        parts = info.get(f"{TAG}/{i}") or {}
        if "unchecked" in parts:
            checks.append(Check(tier=1, name=f"layer{i}:{label}/out", metric="-", value=float("inf"), tolerance=0.0,
                                verdict="fail", layer=i, op=label, detail=str(parts["unchecked"])[:300]))
            continue
        found = _layer_checks(ours.layers[i], truth, parts, i, label, rotary, seed)
        checks += with_scales(found, scales_read(weight_map, [i]))
    return checks


def _layer_checks(our_layer, truth: dict, parts: dict, i: int, label: str, rotary, seed: int) -> list[Check]:
    h = expect(truth, f"{TAG}/{i}/in").clone().requires_grad_(True)
    their_out = expect(truth, f"{TAG}/{i}/out", h.shape)
    our_out = our_layer(h, rotary)
    name = f"layer{i}:{label}"
    checks = [Check.from_comparison(1, f"{name}/out", compare(our_out, their_out, tolerance_for("layer", torch.float32)),
                                    layer=i, op=label)]
    (our_out.double() * cotangent(our_out.shape, seed)).sum().backward()
    grad = compare(h.grad, expect(truth, f"{TAG}/{i}/grad_input", h.shape), tolerance_for("layer", torch.float32, "grad"))
    checks.append(Check.from_comparison(1, f"{name}/grad:input", grad, layer=i, op=label))
    return checks + _lora_grad_checks(our_layer, truth, parts, i, name)


def _lora_grad_checks(our_layer, truth: dict, parts: dict, i: int, name: str) -> list[Check]:
    """Our LoRA-target weights' gradients against the release layer's same-named ones (named from the layer down,
    its attention and FFN under the attribute names the worker reported)."""
    if our_layer.own is not None:
        pairs = (("", our_layer.own.module),)
    else:
        pairs = ((parts.get("attention"), own_or_ours(our_layer.attn)), (parts.get("ffn"), own_or_ours(our_layer.ffn)))
    checks = []
    for prefix, our_part in pairs:
        if prefix is None:
            continue  # the release's layer names this part otherwise: its gradients are in the layer's checks
        for pname, param in our_part.named_parameters():
            theirs = truth.get(f"{TAG}/{i}/grad/{prefix + '.' if prefix else ''}{pname}")
            if not LORA_TARGETS.search(pname) or theirs is None or theirs.shape != param.shape or param.grad is None:
                continue
            c = compare(param.grad, theirs, tolerance_for("layer", torch.float32, "grad"))
            checks.append(Check.from_comparison(1, f"{name}/grad:{pname}", c, layer=i, op="lora_target"))
    return checks
