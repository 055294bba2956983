"""PKG/PR.md, the text a person reviews before trusting the package (templates/pr.md.j2).

Everything comes from what the package holds (package.yaml, gap report, plan.yaml, alignment/report.json)
plus the graph's tasks; this module turns it into plain rows for the template. Strings that come from the
release (config values, tensor and module names) pass through `cell`: one line, control characters
escaped, and `|`, `<`, `>` and backticks neutralized, so they can neither break a table nor inject markup.
"""
from __future__ import annotations

import difflib
import inspect
import json
import math
from pathlib import Path

import yaml

from onboard.align.regression import HIGHER_IS_BETTER
from onboard.align.report import AlignmentReport, Check
from onboard.errors import printable
from onboard.gap.render import jinja_env
from runtime.registry import OPS

# The registry op whose torch form is the nearest existing code for a generated op of each kind: a
# generated activation replaces the gate activation the dense SwiGLU MLP applies; a router scoring the
# router's; a norm, rope or decay their own op; a residual mixing the residual add the MLP op takes.
CLOSEST_OP = {"activation": "swiglu_mlp", "router_scoring": "moe_router", "norm": "rms_norm", "rope": "rope",
              "linear_attention_decay": "gated_delta_rule", "residual_mixing": "swiglu_mlp"}


def cell(value) -> str:
    text = printable(str(value))
    for raw, safe in (("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("`", "'")):
        text = text.replace(raw, safe)
    return text


def render_pr(pkg: Path, spec, report, tasks, exit_code: int) -> str:
    env = jinja_env()
    env.filters["cell"] = cell
    aligned = _alignment(pkg)
    plan = yaml.safe_load((pkg / "plan.yaml").read_text())
    return env.get_template("pr.md.j2").render(
        spec=spec, report=report, tasks=tasks, generated=[generated_row(t.accepted) for t in tasks if t.accepted],
        package=yaml.safe_load((pkg / "package.yaml").read_text()), exit_code=exit_code,
        tiers=[tier_row(t) for t in aligned.tiers] if aligned else [], alignment=aligned,
        flips=tier2_checks(aligned, lambda c: c.metric == "routing_flips"), plan=plan,
        precision=tier2_checks(aligned, lambda c: c.name.startswith("logits/")), scales=scale_rows(aligned),
        own=[o for o in report.ops if o.status == "own"],
        variants=[o for o in report.ops if o.status == "variant"],
        # own parts of a family transformers does not know: nothing here can run them
        unrunnable=[o for o in report.ops if o.status == "missing" and o.covers.endswith(":own_module")])


def _alignment(pkg: Path) -> AlignmentReport | None:
    path = pkg / "alignment" / "report.json"
    return AlignmentReport.model_validate_json(path.read_text()) if path.is_file() else None


def generated_row(op) -> dict:
    """The generated op with its evidence and its unified diff against the closest registry op's torch form."""
    closest = CLOSEST_OP.get(op.kind)
    return {"op": op, "closest": closest, "torch_form": OPS[closest].torch_form if closest else None,
            "diff": op_diff(op.source, closest, op.file) if closest else "",
            "evidence": json.dumps(op.evidence, sort_keys=True, default=str)}


def op_diff(source: str, closest: str, file: str) -> str:
    family = OPS[closest]
    base = inspect.getsource(family.resolve("torch_form"))
    lines = difflib.unified_diff(base.splitlines(keepends=True), source.splitlines(keepends=True),
                                 fromfile=family.torch_form, tofile=f"ops/{file}")
    # a fence inside the diff would end the code block early
    return "".join(lines).replace("```", "'''")


def closeness(check: Check) -> float:
    """How much of the tolerance a check uses (1 = on the bar); inf for a non-finite value."""
    if not math.isfinite(check.value):
        return math.inf
    if check.metric in HIGHER_IS_BETTER:
        return (1 - check.value) / (1 - check.tolerance) if check.tolerance < 1 else 0.0
    return check.value / check.tolerance if check.tolerance > 0 else (math.inf if check.value > 0 else 0.0)


def tier_row(tier) -> dict:
    judged = [c for c in tier.checks if c.verdict in ("pass", "fail")]
    worst = max(judged, key=closeness, default=None)
    return {"tier": tier.tier, "passed": tier.passed, **tier.counts(), "worst": worst,
            "share": closeness(worst) if worst else None}


def tier2_checks(aligned: AlignmentReport | None, keep) -> list[Check]:
    """Tier 2's checks that `keep` selects: the routing-flip counts, the logits bars per precision."""
    if aligned is None:
        return []
    return [c for t in aligned.tiers if t.tier == 2 for c in t.checks if keep(c)]


def scale_rows(aligned: AlignmentReport | None) -> list[dict]:
    """The scale tensors the checks read (stored-format releases), one row per tier and set of tensors: the checks'
    groups (the name up to its first `/`), how many checks, and the tensors."""
    rows: dict[tuple, dict] = {}
    for tier in aligned.tiers if aligned else []:
        for c in tier.checks:
            if not c.scales:
                continue
            row = rows.setdefault((tier.tier, tuple(c.scales)), {"tier": tier.tier, "groups": [], "count": 0,
                                                                   "scales": c.scales})
            group = c.name.split("/", 1)[0]
            if group not in row["groups"]:
                row["groups"].append(group)
            row["count"] += 1
    return list(rows.values())
