"""Generated operators as the package records them, and the gap report once they close their gaps.

A GeneratedOp is a candidate that passed validation (agents/validate.py): its source and unit test go
into PKG/ops/, its entry into package.yaml's generated_ops, and the gaps it closes become `generated`
in the gap report with the validation evidence.
"""
from __future__ import annotations

from pydantic import BaseModel

from onboard.gap.report import GapReport, summarize


class GeneratedOp(BaseModel):
    kind: str  # what it extends in the runtime (runtime/package_ops.py TABLES), e.g. "activation"
    name: str  # the name the spec uses, e.g. the config's hidden_act
    file: str  # ops/<file>.py inside the package
    source: str
    test_source: str
    reference: str  # what it was validated against ("module:qualname" of the model's own implementation)
    closes: dict[str, list[int]]  # registry op -> layers whose gap it closes
    evidence: dict  # validation summary: seeds, checks, worst metrics, sandbox mode, attempts


def mark_generated(report: GapReport, generated: list[GeneratedOp]) -> GapReport:
    """Missing ops whose every layer a generated op closes become `generated`, with its evidence."""
    ops = []
    for gap in report.ops:
        closing = [g for g in generated if set(gap.layers) <= set(g.closes.get(gap.op, []))]
        if gap.status == "missing" and closing:
            g = closing[0]
            gap = gap.model_copy(update=dict(status="generated", runtime_op=f"ops/{g.file}:op", needs=None,
                                             detail=f"generated {g.kind} {g.name!r}, validated against {g.reference}",
                                             evidence=g.evidence))
        ops.append(gap)
    return report.model_copy(update=dict(ops=ops, summary=summarize(ops, report.weights, report.meta_check)))
