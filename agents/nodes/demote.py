"""demote: after a failed alignment, the next rung of onboard/review/demotion.py. The spec is re-planned with the
release's own modules where ours disagreed, the gap report redone, and the failed package removed, so assemble
writes the new one and align checks it again."""
from __future__ import annotations

import shutil
from typing import Optional

from langgraph.runtime import Runtime

from onboard.gap.report import analyze as gap_analysis
from onboard.package.derivation import apply_step
from onboard.review.demotion import Rung, demotion_step, next_rung

from agents.context import Context
from agents.nodes.understand import manifest
from agents.state import Demotion, OnboardState


def rung(state: OnboardState) -> Optional[Rung]:
    """The rung the latest alignment calls for, or None (passed, or nothing left to demote)."""
    aligned, done = state.get("alignment"), [d.rung for d in state.get("demotions", [])]
    if aligned is None or not _transformers_model_built(state):
        return None
    return next_rung(state["spec"], aligned.failed_tier, aligned.failed, done)


def _transformers_model_built(state: OnboardState) -> bool:
    """Every rung runs transformers' modules of the release: there are none when transformers does not know the
    family (no meta check) or could not build its model from the release's config."""
    report = state.get("report")
    return report is None or (report.meta_check is not None and report.meta_check.built)


def demote(state: OnboardState, runtime: Runtime[Context]) -> dict:
    o, step = state["options"], rung(state)
    failed = state["alignment"].failed
    change = demotion_step(state["spec"], step, failed)
    spec = apply_step(state["spec"], manifest(o.model_dir), change)
    report = gap_analysis(spec, manifest(o.model_dir), o.gpu_mem_gib, o.lora_rank, o.seq_len)
    own = [f"{g.op} (layers {','.join(map(str, g.layers))})" for g in report.ops if g.op.startswith("own:")]
    runtime.context.progress(f"demote ({step}): {failed[0].name} failed; now own modules: {', '.join(own)}")
    # the package that failed is replaced by the re-planned one; its failing checks stay in the state
    shutil.rmtree(state["package"], ignore_errors=True)
    return {"spec": spec, "spec_steps": [*state.get("spec_steps", []), change], "report": report, "alignment": None,
            "demotions": [*state.get("demotions", []), Demotion(rung=step, failed=failed)]}
