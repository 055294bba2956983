"""Demotion after a failed alignment: where the assembled package does not compute what the release computes,
the release's own transformers modules (the oracle alignment compared against) take over, one rung at a time.

Rungs, each tried at most once, so a run ends:
- "layers": tier 1 failed. Tier 1 compares whole decoder layers, so it cannot tell which component of a
  failing layer kind disagrees: every layer of that kind runs as transformers' decoder layer (own_layer).
- "model": the layers agree but tier 2's model-level checks (logits, loss) do not, so the glue between
  them (embedding and logit scaling, final norm, head) is not what the release computes; or a layer rung
  could not help (its layers already were own layers, or the failure names no layer). The whole model
  runs as transformers' own (own:model).
The reasons name the registry ops that disagreed, the check, its metric and its bar. A release that stores its
weights quantized gets no rung (next_rung says why).
"""
from __future__ import annotations

from typing import Literal, Optional

from onboard.align.report import Check
from onboard.align.tiers.tier1_layers import layer_label
from onboard.package.derivation import OwnStep, apply_step
from onboard.release.manifest import Manifest
from runtime.registry import ops_for_layer
from runtime.spec import ModelSpec

Rung = Literal["layers", "model"]
MODEL_CHECKS = ("logits/", "loss/")


def next_rung(spec: ModelSpec, failed_tier: Optional[int], failed: list[Check], done: list[str]) -> Optional[Rung]:
    """The rung to try after an alignment that failed at `failed_tier` with `failed` checks (None: passed);
    None when no rung is left that could change what is computed."""
    # a release that stores weights quantized has no rung: the runtime holds stored weights in its own layers only
    # (runtime/model/stored.py), and a wrong scale in the files (tier 1's stored gain checks) is no code to replace
    if failed_tier is None or spec.own_model or spec.stored_format is not None:
        return None
    if failed_tier == 1 and "layers" not in done and _layer_reasons(spec, failed):
        return "layers"
    model_level = failed_tier == 1 or any(c.name.startswith(MODEL_CHECKS) for c in failed)
    return "model" if model_level and failed_tier in (1, 2) and "model" not in done else None


def replan(spec: ModelSpec, manifest: Manifest, rung: Rung, failed: list[Check]) -> ModelSpec:
    """The spec demoted by one rung."""
    return apply_step(spec, manifest, demotion_step(spec, rung, failed))


def demotion_step(spec: ModelSpec, rung: Rung, failed: list[Check]) -> OwnStep:
    """The rung as the step package.yaml records (its layers and reasons), so readers derive the same spec."""
    if rung == "layers":
        return OwnStep(own_layers=_layer_reasons(spec, failed))
    reason = f"the model's glue disagreed with the release's model: {_evidence(_first(failed, MODEL_CHECKS))}"
    return OwnStep(own_model=reason, own_layers={layer.index: reason for layer in spec.layers})


def _layer_reasons(spec: ModelSpec, failed: list[Check]) -> dict[int, str]:
    """Layer index -> why, for every layer of a kind a tier-1 check failed on (own layers excluded: they
    already are the release's module)."""
    labels = {layer.index: layer_label(layer) for layer in spec.layers}
    failing: dict[str, Check] = {}
    for check in failed:
        if check.layer is not None and labels.get(check.layer, "own_layer") != "own_layer":
            failing.setdefault(labels[check.layer], check)
    reasons = {}
    for layer in spec.layers:
        check = failing.get(labels[layer.index])
        if check is not None:
            ops = [name for name, _ in ops_for_layer(layer.attention, layer.ffn)]
            what = ", ".join(ops) if ops else "the layer's norms and residuals"
            reasons[layer.index] = f"{what} disagreed with the release's decoder layer: {_evidence(check)}"
    return reasons


def _first(failed: list[Check], prefixes: tuple[str, ...]) -> Check:
    return next((c for c in failed if c.name.startswith(prefixes)), failed[0])


def _evidence(check: Check) -> str:
    """'layer0:softmax+moe/out rel_rms 1.2e-01 > 1e-03, max_abs_rel=...': the check, its metric and its bar."""
    detail = f", {check.detail}" if check.detail else ""
    return f"{check.name} {check.metric} {check.value:.1e} over its bar {check.tolerance:.0e}{detail}"
