"""Gaps -> tasks: which missing ops a generated candidate can close, and what the report says about the rest.

A task exists for each distinct (kind, name) the runtime lacks, e.g. activation "relu2" used by the experts
and the shared expert. It needs an LLM when the runtime has a slot for that kind and the model's own
implementation is there to validate against; otherwise a person.
"""
from __future__ import annotations

from onboard.gap.generated import mark_generated
from onboard.gap.report import GapReport
from onboard.recognize import model_references
from runtime.package_ops import TABLES
from runtime.registry import OPS, SpecPart, ops_for_layer
from runtime.spec import ModelSpec, Unrecognized

from agents.state import Explanation, Failure, OpTask

# registry op -> (candidate kind, the parameter naming what the op lacks); a residual mixing has no registry op,
# so no gap names one yet
GAP_KINDS = {"moe_experts": ("activation", "activation"), "swiglu_mlp": ("activation", "activation"),
             "moe_router": ("router_scoring", "router"), "rms_norm": ("norm", "kind"), "rope": ("rope", "scaling"),
             "gated_delta_rule": ("linear_attention_decay", "decay")}


def _name(part: SpecPart, key: str) -> str:
    """The name of what the op lacks, from the spec part its predicate judged."""
    if key == "router":
        return part.router.scoring
    if key == "scaling":
        scaling = part.scaling or {}
        return scaling.get("rope_type", scaling.get("type", "default"))
    return str(getattr(part, key))


def tasks_for(spec: ModelSpec) -> list[OpTask]:
    found: dict[tuple[str, str], dict[str, list[int]]] = {}
    for layer in spec.layers:
        used = [("rms_norm", spec.norm)] + ops_for_layer(layer.attention, layer.ffn)
        for op, part in used:
            if op in GAP_KINDS and OPS[op].supports(part) == "unsupported":
                kind, key = GAP_KINDS[op]
                found.setdefault((kind, _name(part, key)), {}).setdefault(op, []).append(layer.index)
    return [_task(kind, name, closes) for (kind, name), closes in sorted(found.items())]


def _task(kind: str, name: str, closes: dict[str, list[int]]) -> OpTask:
    has_reference = model_references.reference(kind, name) is not None
    reference = model_references.describe(kind, name) if has_reference else None
    if kind not in TABLES:
        why = f"the runtime has no slot for a generated {kind} yet (runtime/package_ops.py)"
    elif not has_reference:
        why = f"no implementation of {kind} {name!r} to validate a candidate against"
    else:
        return OpTask(kind=kind, name=name, closes=closes, reference=reference, needs="llm")
    return OpTask(kind=kind, name=name, closes=closes, reference=reference, needs="person", status="missing",
                  failures=[Failure(check="reference", detail=why)])


def without_llm(task: OpTask) -> OpTask:
    if task.status != "pending":
        return task
    failure = Failure(check="llm", detail="no LLM endpoint configured (--llm-url): a candidate was not generated")
    return task.model_copy(update=dict(status="missing", failures=[failure]))


def final_report(report: GapReport, tasks: list[OpTask], explanations: list[Explanation] = ()) -> GapReport:
    """Accepted candidates' gaps become `generated`; the rest say who can close them and why they are open;
    each unrecognized item carries who can explain it and the explanation validated or refused."""
    report = mark_generated(report, [t.accepted for t in tasks if t.accepted is not None])
    ops = []
    for gap in report.ops:
        task = next((t for t in tasks if t.status == "missing" and gap.op in t.closes
                     and set(t.closes[gap.op]) & set(gap.layers)), None)
        if gap.status == "missing" and task is not None:
            gap = gap.model_copy(update=dict(
                needs=task.needs, detail=f"{gap.detail}: {task.kind} {task.name!r}",
                evidence={"attempts": task.attempts, "failures": [f.model_dump() for f in task.failures]}))
        ops.append(gap)
    return report.model_copy(update=dict(ops=ops, unrecognized=[_explained(u, explanations) for u in report.unrecognized]))


def _explained(item: Unrecognized, explanations: list[Explanation]) -> Unrecognized:
    found = next((e for e in explanations if (e.source, e.item) == (item.source, item.item)), None)
    if found is None:
        return item
    return item.model_copy(update=dict(needs=found.needs, explanation=found.model_dump(
        include={"status", "proposal", "failures", "evidence"})))
