"""plan, assemble, align, review: the package written (atomically, by onboard/package/writer.py), aligned, explained."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml
from langgraph.runtime import Runtime

from onboard.align import run_alignment
from onboard.align.progress import Progress
from onboard.exit_codes import Exit
from onboard.package.writer import PackageContents, record_outcome, replace_text, write
from onboard.plan.search import Cluster, package_plan
from onboard.review.pr import render_pr

from agents.context import Context
from agents.nodes.understand import manifest
from agents.state import Alignment, Demotion, OnboardState
from agents.tasks import final_report

ALIGN_TIERS = [0, 1, 2]


def plan(state: OnboardState, runtime: Runtime[Context]) -> dict:
    """plan.yaml's parallel plan for the options' cluster, of the spec as it stands (again after a demotion)."""
    o, memory = state["options"], state["report"].memory
    planned = package_plan(state["spec"], Cluster(o.gpus, o.gpu_mem_gib, o.gpus_per_node), o.seq_len, o.lora_rank)
    c = planned.chosen
    chosen = f"{c.mesh}, {c.policy}, micro-batch {c.micro_batch}" if c else f"nothing fits ({planned.reason})"
    runtime.context.progress(f"plan: at least {memory.min_gpus} GPU(s) of {memory.gpu_mem_gib:g} GiB; "
                             f"on {o.gpus}: {chosen}")
    return {"plan": planned}


def assemble(state: OnboardState, runtime: Runtime[Context]) -> dict:
    """Writes what the state holds: the spec and the steps to it, the final gap report (generated ops marked,
    open ones with who can close them), the plan and the accepted candidates."""
    o, tasks = state["options"], state["tasks"]
    out = Path(o.out)
    report = final_report(state["report"], tasks, state.get("explanations", []))
    # a run killed between the rename and its checkpoint wrote this package already: keep it
    if not _written_by_this_run(out, state):
        model_dir = Path(o.model_dir).resolve()
        write(out, PackageContents(model_dir, manifest(o.model_dir), state["spec"], state.get("spec_steps", []),
                                   report, state["plan"], o.lora_rank,
                                   [t.accepted for t in tasks if t.accepted is not None]))
    runtime.context.progress(f"assemble: wrote {out}")
    return {"package": str(out), "report": report}


def _written_by_this_run(out: Path, state: OnboardState) -> bool:
    if not (out / "package.yaml").exists():
        return False
    written = yaml.safe_load((out / "package.yaml").read_text())
    return written.get("spec_hash") == state["spec"].spec_hash() and \
        written.get("source", {}).get("absolute") == str(Path(state["options"].model_dir).resolve())


def align(state: OnboardState, runtime: Runtime[Context]) -> dict:
    options = state["options"]
    tiers = sorted(set(ALIGN_TIERS) | set(options.align_tiers))
    # tier 4 checks the cluster plan.yaml was planned for
    cluster = Cluster(options.gpus, options.gpu_mem_gib, options.gpus_per_node) if 4 in tiers else None
    report = run_alignment(Path(state["package"]), tiers, progress=Progress(runtime.context.progress), cluster=cluster)
    failed = next((t for t in report.tiers if not t.passed), None)
    return {"alignment": Alignment(passed=report.passed, summary=report.summary_line(),
                                   failed_tier=failed.tier if failed else None,
                                   failed=[c for c in failed.checks if c.verdict == "fail"] if failed else [])}


def review(state: OnboardState, runtime: Runtime[Context]) -> dict:
    """package.yaml's status and reasons, PR.md; the LLM log, every task's attempts and every explanation
    into PKG/agents/; the exit code."""
    pkg, report, aligned = Path(state["package"]), state["report"], state.get("alignment")
    folder = pkg / "agents"
    folder.mkdir(exist_ok=True)
    log = runtime.context.run_dir / "llm.jsonl"
    if log.exists():
        shutil.copy(log, folder / "llm.jsonl")
    (folder / "tasks.json").write_text(json.dumps([t.model_dump(exclude={"accepted"}) for t in state["tasks"]], indent=1))
    (folder / "explanations.json").write_text(json.dumps([e.model_dump() for e in state.get("explanations", [])], indent=1))
    demotions = state.get("demotions", [])
    (folder / "demotions.json").write_text(json.dumps([d.model_dump(mode="json") for d in demotions], indent=1))
    status, reasons = outcome(report, aligned)
    reasons += [demotion_reason(d) for d in demotions]
    record_outcome(pkg, status, reasons)
    # a plain int in the checkpointed state
    exit_code = int(Exit.OK if status == "trainable" else Exit.GAPS)
    replace_text(pkg / "PR.md", render_pr(pkg, state["spec"], report, state["tasks"], exit_code))
    return {"exit_code": exit_code}


def outcome(report, aligned: Alignment | None) -> tuple[str, list[str]]:
    """("trainable" | "gaps" | "alignment-failed", why): what package.yaml records."""
    if report.summary["gaps_remain"]:
        w = report.weights
        reasons = [f"{o.op} ({o.status}, needs {o.needs or 'person'}): {o.detail}" for o in report.ops
                   if o.status == "missing"]
        reasons += [f"weights: {len(names)} {what}" for what, names in
                    (("missing", w.missing), ("unexpected", w.unexpected), ("with a shape mismatch", w.shape_mismatches))
                    if names]
        return "gaps", reasons
    if aligned is None or not aligned.passed:
        return "alignment-failed", [aligned.summary if aligned else "alignment did not run"]
    return "trainable", []


def demotion_reason(step: Demotion) -> str:
    """Why a demotion after a failed alignment replaced registry ops with the release's own (slow) modules."""
    c = step.failed[0]
    return (f"demoted ({step.rung}): tier {c.tier} check {c.name} failed ({c.metric} {c.value:.1e} over its bar {c.tolerance:.0e}), "
            "so the release's own transformers modules run there (slow: nothing fused); see gap_report.json own:*")
