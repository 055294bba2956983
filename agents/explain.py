"""Unrecognized items -> explanations: which an LLM may explain, the prompt asking it, and the proposal applied.

A config key our rules leave unread may be explained by the LLM as a parameter of a registry op (a spec field
and its value) or as nothing the layers compute; the proposal counts only once tiers 0-1 pass on a trial
package built from the spec with it applied (agents/nodes/explain.py). Weight names and the release's own
module classes need a person: a weight needs a recognition rule and a weight-map entry, and the release's
code is never run here, so nothing could confirm an explanation of it.
"""
from __future__ import annotations

import json
from typing import Any

from onboard.gap.render import jinja_env
from onboard.gap.report import GapReport
from onboard.package.derivation import SetStep, StepError, set_parameter
from onboard.release.model_source import config_doc
from runtime.registry import OPS, ops_for_layer
from runtime.spec import ModelSpec

from agents.state import Explanation, Failure, Proposal

NO_LLM = Failure(check="llm", detail="no LLM endpoint configured (--llm-url): nobody proposed what it is")
WHY_PERSON = {"config.json:auto_map": "the release's own module class: its code is never run here, so a person "
                                      "checks that recognition from keys and weights matches it",
              "weights": "a tensor nothing reads: it needs a recognition rule and a weight-map entry"}


def explanations_for(report: GapReport, config: dict, has_llm: bool) -> list[Explanation]:
    return [_explanation(u.source, u.item, config, has_llm) for u in report.unrecognized]


def _explanation(source: str, item: str, config: dict, has_llm: bool) -> Explanation:
    person = next((why for prefix, why in WHY_PERSON.items() if source.startswith(prefix)), None)
    if person is not None:
        return Explanation(source=source, item=item, needs="person", status="open",
                           failures=[Failure(check="person", detail=person)])
    value = _config_value(config, source.removeprefix("config.json:"))
    if not has_llm:
        return Explanation(source=source, item=item, value=value, needs="llm", status="open", failures=[NO_LLM])
    return Explanation(source=source, item=item, value=value, needs="llm")


def _config_value(config: dict, dotted: str) -> Any:
    value: Any = config
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def prompt(explanation: Explanation, spec: ModelSpec) -> str:
    key = explanation.item.rsplit(".", 1)[-1]
    return jinja_env().get_template("prompts/unrecognized.md.j2").render(
        family=spec.family, architecture=spec.architecture, item=explanation.item, source=explanation.source,
        value=json.dumps(explanation.value), doc=config_doc(spec.family, key), layers=_layer_parameters(spec),
        top=_flatten({"norm": spec.norm.model_dump()}), ops=sorted(OPS))


def _layer_parameters(spec: ModelSpec) -> list[dict]:
    """One entry per distinct layer kind: its layers, the registry ops it uses and its parameters by path."""
    kinds: dict[str, dict] = {}
    for layer, kind in zip(spec.layers, spec.layer_kinds()):
        entry = kinds.setdefault(kind, {"kind": kind, "layers": [], "ops": [], "parameters": {}})
        entry["layers"].append(layer.index)
        if len(entry["layers"]) == 1:
            entry["ops"] = [op for op, _ in ops_for_layer(layer.attention, layer.ffn)]
            entry["parameters"] = _flatten({"attention": layer.attention.model_dump(), "ffn": layer.ffn.model_dump(),
                                            "residual": layer.residual.model_dump()})
    return list(kinds.values())


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value and key != "tensors":
            flat.update(_flatten(value, f"{prefix}{key}."))
        elif not isinstance(value, (dict, list)):
            flat[f"{prefix}{key}"] = value
    return flat


def step_for(proposal: Proposal, config_value: Any) -> SetStep | Failure | None:
    """The spec step the proposal asks for (None: it changes nothing computed), or why it cannot be one."""
    if proposal.op == "none":
        return Failure(check="proposal", detail="op \"none\" sets no parameter") if proposal.parameter else None
    if proposal.op not in OPS:
        return Failure(check="proposal", detail=f"op {proposal.op!r} is not a registry op ({', '.join(sorted(OPS))})")
    if not proposal.parameter:
        return Failure(check="proposal", detail=f"a parameter of {proposal.op} needs the spec field it sets")
    return SetStep(set=proposal.parameter, value=proposal.value if proposal.value is not None else config_value)


def apply(spec: ModelSpec, proposal: Proposal, config_value: Any) -> ModelSpec | Failure:
    """The spec with the proposal's interpretation applied, or why it cannot be."""
    step = step_for(proposal, config_value)
    if step is None or isinstance(step, Failure):
        return spec if step is None else step
    try:
        return set_parameter(spec, step.set, step.value)
    except StepError as err:
        return Failure(check="proposal", detail=str(err))
