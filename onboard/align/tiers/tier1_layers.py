"""Alignment tier 1: each distinct layer type against the model's own transformers layer.

A layer runs on the hidden states transformers fed it, forward and backward: the output, the input
gradient and the gradients of LoRA-targetable weights are compared in fp32.
"""
from __future__ import annotations

from pathlib import Path

import torch

from onboard.align.progress import Progress
from onboard.align.reference import (Recorder, attention_module, decoder_layers, ffn_module, first_tensor, load_reference,
                                     load_runtime, random_tokens)
from onboard.align.report import Check, with_scales
from onboard.align.release_code import ships_code
from onboard.align.stored import scales_read
from onboard.align.tiers.layer_grads import LORA_TARGETS, cotangent, own_or_ours
from onboard.align.tiers.release_layers import release_layer_checks
from onboard.align.tiers.stored_gain import gain_checks
from onboard.release.manifest import read_manifest
from runtime.model.rotary import RotaryCache
from runtime.spec import LayerSpec, ModelSpec
from runtime.tolerances import compare, tolerance_for


def layer_label(layer: LayerSpec) -> str:
    if layer.own_layer:
        return "own_layer"
    a = layer.attention
    kind = "mla_dsa" if a.kind == "mla" and a.indexer else a.kind
    return f"{kind}+{layer.ffn.kind}"


def distinct_layers(spec: ModelSpec, num_layers: int) -> dict[str, int]:
    first: dict[str, int] = {}
    for layer in spec.layers[:num_layers]:
        first.setdefault(layer_label(layer), layer.index)
    return first


def hf_rerun(layer, recorded, h):
    """The model's own layer rerun on `h` with the other arguments its model passed it."""
    args, kwargs, _ = recorded
    if args:
        return first_tensor(layer(h, *args[1:], **kwargs))
    return first_tensor(layer(**{**kwargs, "hidden_states": h}))


def _backward_both(hf_out, our_out, seed: int) -> None:
    grad = cotangent(hf_out.shape, seed)
    (hf_out.double() * grad).sum().backward()
    (our_out.double() * grad).sum().backward()


def _lora_grad_checks(hf_layer, our_layer, index: int, name: str) -> list[Check]:
    checks = []
    if not hasattr(our_layer, "own"):
        pairs = ((hf_layer, our_layer),)  # transformers' layer inside a model run whole as its own
    elif our_layer.own is not None:
        pairs = ((hf_layer, our_layer.own.module),)
    else:
        pairs = ((attention_module(hf_layer), own_or_ours(our_layer.attn)),
                 (ffn_module(hf_layer), own_or_ours(our_layer.ffn)))
    for hf_part, our_part in pairs:
        if hf_part is None:
            continue  # transformers' layer names this part otherwise: its gradients are in the layer's checks
        hf_params = dict(hf_part.named_parameters())
        for pname, ours in our_part.named_parameters():
            theirs = hf_params.get(pname)
            if not LORA_TARGETS.search(pname) or theirs is None or theirs.shape != ours.shape or theirs.grad is None:
                continue
            c = compare(ours.grad, theirs.grad, tolerance_for("layer", torch.float32, "grad"))
            checks.append(Check.from_comparison(1, f"{name}/grad:{pname}", c, layer=index, op="lora_target"))
    return checks


def tier1(spec: ModelSpec, weight_map: dict, source: Path, num_layers: int, T: int = 17, seed: int = 0,
          progress: Progress | None = None) -> list[Check]:
    progress = progress or Progress()
    layers = distinct_layers(spec, num_layers)
    manifest = read_manifest(source) if spec.stored_format is not None else None
    progress.plan(1 + len(layers) + (manifest is not None))
    checks = []
    if manifest is not None:
        progress.group("stored weights: the gain each decodes to")
        checks += gain_checks(manifest, num_layers)
    if ships_code(source):
        # its own code is the reference, run confined
        progress.group("the release's own code, confined")
        return checks + release_layer_checks(spec, weight_map, source, num_layers, layers, T, seed, progress)
    progress.group("transformers reference run")
    ref = load_reference(source, spec.family, torch.float32, num_layers)
    ours = load_runtime(spec, weight_map, source, torch.float32, num_layers)
    recorder = Recorder(ref)
    with torch.no_grad():
        ref(input_ids=random_tokens(spec, 1, T, seed), use_cache=False)
    recorder.close()
    rotary = RotaryCache(torch.arange(T)[None])
    # a model run whole as transformers' own: its layers, as the runtime loaded them, take transformers' arguments
    our_layers = ours.own.decoder_layers() if ours.own is not None else ours.layers
    for label, i in layers.items():
        progress.group(f"layer {i} ({label})")
        found = _layer_checks(decoder_layers(ref)[i], our_layers[i], recorder, i, label, rotary, seed)
        checks += with_scales(found, scales_read(weight_map, [i]))
    return checks


def _layer_checks(hf_layer, our_layer, recorder: Recorder, i: int, label: str, rotary, seed: int) -> list[Check]:
    """Both layers on the input transformers fed layer i: output, input gradient, LoRA-target gradients."""
    h_hf = recorder.input("layer", i).clone().requires_grad_(True)
    h_ours = h_hf.detach().clone().requires_grad_(True)
    recorded = recorder.calls[("layer", i)]
    hf_out = hf_rerun(hf_layer, recorded, h_hf)
    our_out = our_layer(h_ours, rotary) if hasattr(our_layer, "own") else hf_rerun(our_layer, recorded, h_ours)
    name = f"layer{i}:{label}"
    out = compare(our_out, hf_out, tolerance_for("layer", torch.float32))
    checks = [Check.from_comparison(1, f"{name}/out", out, layer=i, op=label)]
    _backward_both(hf_out, our_out, seed)
    grad = compare(h_ours.grad, h_hf.grad, tolerance_for("layer", torch.float32, "grad"))
    checks.append(Check.from_comparison(1, f"{name}/grad:input", grad, layer=i, op=label))
    return checks + _lora_grad_checks(hf_layer, our_layer, i, name)

