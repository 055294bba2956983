"""What a package's spec and weight map are, derived from its release: the one derivation `new-model` writes
and every reader re-runs.

The spec is the release recognized (onboard/recognize/recognizer.py) and then changed by the steps the onboarding graph
took, recorded in package.yaml's `spec_steps` in order: an LLM explanation that passed tiers 0-1 sets one
spec field (`set`/`value`), a demotion after a failed alignment runs layers (or the whole model) as the
release's own modules (`own_layers`, `own_model`, with their reasons). The weight map follows from the spec and the
release's tensors. A reader that re-derives both and finds them equal to spec.json and weight_map.json knows
the package computes what new-model decided, whatever was edited and re-hashed since.
"""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError

from onboard.release.manifest import Manifest
from onboard.release.naming import outside_text
from runtime.spec import ModelSpec


class SetStep(BaseModel):
    """An explanation's spec field: a path inside each layer ("ffn.top_k") or from the top, and its value."""
    model_config = ConfigDict(extra="forbid")
    set: Annotated[str, Field(min_length=1)]
    value: Any  # the config key's own value where the proposal gives none (a list or mapping too)


class OwnStep(BaseModel):
    """A demotion rung: these layers (and with `own_model`, the whole model) run as the release's modules."""
    model_config = ConfigDict(extra="forbid")
    own_model: Optional[str] = None
    own_layers: dict[NonNegativeInt, str]


SpecStep = Union[SetStep, OwnStep]


class StepError(ValueError):
    """A step that cannot be applied to the spec (a field it does not have, a value its schema refuses)."""


def derive_spec(manifest: Manifest, steps: list[SpecStep] = ()) -> ModelSpec:
    from onboard.recognize.recognizer import recognize

    spec = recognize(manifest)
    for step in steps:
        spec = apply_step(spec, manifest, step)
    return spec


def apply_step(spec: ModelSpec, manifest: Manifest, step: SpecStep) -> ModelSpec:
    if isinstance(step, SetStep):
        return set_parameter(spec, step.set, step.value)
    from onboard.recognize.weights import run_own

    if step.own_model is not None:
        spec = spec.model_copy(update={"own_model": step.own_model})
    return run_own(spec, manifest, {(index, "layer"): reason for index, reason in step.own_layers.items()})


def set_parameter(spec: ModelSpec, parameter: str, value: Any) -> ModelSpec:
    """The spec with `parameter` set to `value` wherever the top level or a layer has that field."""
    data = spec.model_dump()
    path = parameter.split(".")
    if sum(_set(root, path, value) for root in [data, *data["layers"]]) == 0:
        raise StepError(f"no field {parameter!r} in the spec or its layers")
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as err:
        raise StepError(f"{parameter} = {value!r}: {str(err)[:400]}") from None


def _set(root: dict, path: list[str], value: Any) -> bool:
    """Sets root[path] where every key of the path is there already; whether it was."""
    *parents, last = path
    for key in parents:
        root = root.get(key) if isinstance(root, dict) else None
    if not isinstance(root, dict) or last not in root:
        return False
    root[last] = value
    return True


def derive_weight_map(spec: ModelSpec, manifest: Manifest) -> dict[str, dict]:
    """Released tensor name -> runtime entry (onboard/package/weight_map.py), as new-model writes it."""
    from onboard.gap.report import check_weights
    from onboard.package.weight_map import build_weight_map

    own_names = _own_model_names(manifest) if spec.own_model else None
    # other towers' tensors the vision prefix does not hold (a projector beside the tower) are loaded by nothing
    vision = spec.naming.vision_prefix or "\0"
    others = [n for n in outside_text(manifest.tensors, spec.naming) if not n.startswith(vision)]
    return build_weight_map(spec, check_weights(spec, manifest).unexpected + others, own_names, manifest.stored)


def _own_model_names(manifest: Manifest) -> dict[str, str | None]:
    """Released name -> transformers' name of a model run whole as its own; None where its conversion splits or
    fuses the tensor (no one parameter holds it)."""
    from onboard.recognize.meta_check import transformers_parameter_names, transformers_reshaped

    names = list(manifest.tensors)
    reshaped = transformers_reshaped(manifest, names)
    return {n: None if n in reshaped else hf for n, hf in transformers_parameter_names(manifest, names).items()}
