"""validate: the candidate in the sandbox against the model's own implementation, then alignment tiers 0-1
for its layers on a trial package holding it; refused candidates go back to generate with the evidence."""
from __future__ import annotations

import shutil
import traceback

from langgraph.runtime import Runtime

from onboard.align import run_alignment
from onboard.align.progress import Progress
from onboard.gap.generated import GeneratedOp
from onboard.package.derivation import SpecStep
from onboard.package.writer import write_package

from agents import candidates
from agents.context import Context
from agents.nodes.generate import pending, refused, replace
from agents.state import Failure, OnboardState, OpTask
from agents.validate import STDERR_TAIL, golden, validate as validate_candidate

LAYER_TIERS = [0, 1]
MAX_REPORTED = 6


def validate(state: OnboardState, runtime: Runtime[Context]) -> dict:
    task, options = pending(state), state["options"]
    folder = runtime.context.run_dir / "trials" / f"{task.kind}-{task.name}-{task.attempts}"
    verdict = validate_candidate(task, task.candidate, folder / "sandbox", state["validation_salt"])
    runtime.context.progress(f"validate: {task.kind} {task.name!r} attempt {task.attempts}: "
                             + ("op checks pass" if verdict.passed else f"refused ({verdict.failures[0].check})"))
    if not verdict.passed:
        return {"tasks": replace(state, task, **refused(task, verdict.failures, options.max_attempts))}
    op = generated_op(task, verdict.evidence, state["validation_salt"])
    others = [t.accepted for t in state["tasks"] if t.accepted is not None]
    failures, tiers = trial_failures(state, [*others, op], state.get("spec_steps", []), folder, runtime.context)
    op.evidence["tiers"] = tiers
    if failures:
        return {"tasks": replace(state, task, **refused(task, failures, options.max_attempts))}
    return {"tasks": replace(state, task, status="accepted", candidate=None, failures=[], accepted=op)}


def generated_op(task: OpTask, evidence: dict, salt: int) -> GeneratedOp:
    file = f"{task.kind}_{''.join(c if c.isalnum() else '_' for c in task.name)}.py"
    inputs, expected = golden(task, salt)
    return GeneratedOp(kind=task.kind, name=task.name, file=file, source=task.candidate.source,
                       test_source=candidates.unit_test(task, file, inputs, expected), reference=task.reference,
                       closes=task.closes, evidence={**evidence, "attempts": task.attempts,
                                                     "template": task.candidate.template})


def trial_failures(state: OnboardState, generated: list[GeneratedOp], spec_steps: list[SpecStep], folder,
                   context: Context) -> tuple[list[Failure], dict]:
    """Tiers 0-1 on a trial package of the spec `spec_steps` lead to (onboard/package/derivation.py) with
    `generated` in ops/: the ops at the model's widths, the layers
    vs transformers'. The failing checks (by name, metric and value), and passed/total per tier."""
    o = state["options"]
    shutil.rmtree(folder / "package", ignore_errors=True)
    try:
        pkg, _ = write_package(o.model_dir, folder / "package", o.gpu_mem_gib, o.lora_rank, o.seq_len, o.gpus,
                               o.gpus_per_node, generated=generated, spec_steps=spec_steps)
        report = run_alignment(pkg, LAYER_TIERS, progress=Progress(lambda line: context.progress(f"  {line}")))
    except Exception:  # a candidate's code, or a proposed spec, runs in this process here: what it raises is its failure
        return [Failure(check="tiers", metric="exception", detail=traceback.format_exc()[-STDERR_TAIL:])], {}
    tiers = {str(t.tier): f"{t.num_checks - t.num_failed}/{t.num_checks}" for t in report.tiers}
    if report.passed:
        return [], tiers
    failed = [c for t in report.tiers for c in t.checks if c.verdict == "fail"]
    return [Failure(check=f"tier{c.tier}:{c.name}", metric=c.metric, value=c.value, tolerance=c.tolerance,
                    detail=c.detail or "") for c in failed[:MAX_REPORTED]] or [
        Failure(check="tiers", detail=report.summary_line())], tiers
