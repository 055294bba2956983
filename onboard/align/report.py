"""AlignmentReport: every check with its metric, tolerance and verdict, per tier."""
from __future__ import annotations

import math
import re
from typing import Literal, Optional, get_args

from pydantic import BaseModel, field_serializer, model_validator

from runtime.tolerances import Comparison

Verdict = Literal["pass", "fail", "skip", "info"]


class Check(BaseModel):
    tier: int
    name: str
    metric: str  # "rel_rms", "max_abs_rel", "selection_overlap", "routing_flips", ...
    value: float
    tolerance: float
    verdict: Verdict
    op: Optional[str] = None  # registry op or layer component the check is about
    layer: Optional[int] = None
    detail: str = ""
    # the released scale tensors the checked op or layer read (stored-format releases: FP8 weight_scale_inv,
    # MXFP4 scales), expert numbers folded into ranges (onboard/align/stored.py's fold_experts)
    scales: list[str] = []

    @model_validator(mode="before")
    @classmethod
    def _old_name(cls, data):
        # backward compatibility: reports and baselines written before the torch form had its own word named tier-0
        # checks <op>/fallback/..., so an existing alignment/baseline.json still compares under `align --check`
        if isinstance(data, dict) and data.get("tier") == 0 and isinstance(data.get("name"), str):
            return {**data, "name": re.sub(r"^([^/]+)/fallback(/|$)", r"\1/torch_form\2", data["name"])}
        return data

    @field_serializer("value", "tolerance")
    def _finite(self, v: float):
        # JSON has no Infinity/NaN: write them as strings so the report stays valid JSON
        return v if math.isfinite(v) else str(v)

    @classmethod
    def from_comparison(cls, tier: int, name: str, c: Comparison, **fields) -> "Check":
        """rel_rms is the headline metric; max-abs goes into detail and into the verdict."""
        detail = f"max_abs_rel={c.max_abs_rel:.3e} (tol {c.tolerance.max_abs_rel:.0e})" + ("" if c.finite else "; non-finite output")
        return cls(tier=tier, name=name, metric="rel_rms", value=c.rel_rms, tolerance=c.tolerance.rel_rms,
                   verdict="pass" if c.passed else "fail", detail=detail, **fields)


class Divergence(BaseModel):
    layer: int
    component: str  # "attention" or "ffn"
    kind: str  # e.g. "gated_delta", "moe"
    ops: list[str]  # the registry ops that component runs
    value: float
    tolerance: float


class TierResult(BaseModel):
    tier: int
    passed: bool
    num_checks: int
    num_failed: int
    checks: list[Check]

    def counts(self) -> dict[str, int]:
        """Checks per verdict: a skip is not a pass, an info is no verdict at all."""
        return {verdict: sum(1 for c in self.checks if c.verdict == verdict) for verdict in get_args(Verdict)}

    def summary(self) -> str:
        counts = ", ".join(f"{n} {verdict}" for verdict, n in self.counts().items())
        return f"tier {self.tier}: {'pass' if self.passed else 'FAIL'} ({counts})"


class AlignmentReport(BaseModel):
    package: str
    source: str
    spec_hash: str
    tiers: list[TierResult]
    first_divergence: Optional[Divergence] = None
    passed: bool

    def summary_line(self) -> str:
        parts = [t.summary() for t in self.tiers]
        if self.first_divergence:
            d = self.first_divergence
            parts.append(f"first divergence: layer {d.layer} {d.component} ({d.kind}: {', '.join(d.ops)})")
        return "; ".join(parts)


def with_scales(checks: list[Check], scales: list[str]) -> list[Check]:
    """The checks, each recording the scale tensors its op or layer read (unchanged when none were read)."""
    return [c.model_copy(update={"scales": scales}) for c in checks] if scales else checks


def tier_result(tier: int, checks: list[Check]) -> TierResult:
    failed = sum(1 for c in checks if c.verdict == "fail")
    return TierResult(tier=tier, passed=failed == 0, num_checks=len(checks), num_failed=failed, checks=checks)
