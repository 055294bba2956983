"""explain: the LLM's proposal for each unrecognized config key, applied to the spec and confirmed by tiers 0-1
on a trial package (with the ops generated so far), or refused with the failing checks. One proposal per item;
an accepted one stays applied to the spec the package is written from."""
from __future__ import annotations

from langgraph.runtime import Runtime

from onboard.gap.report import analyze as gap_analysis

from agents import explain as explaining
from agents.context import Context
from agents.llm import LLMError
from agents.nodes.check import trial_failures
from agents.nodes.understand import manifest
from agents.state import Explanation, Failure, OnboardState, Proposal
from agents.tasks import final_report

GAPS_FIRST = Failure(check="tiers", detail="tiers 0-1 confirm an explanation, and they cannot pass while op gaps "
                                           "remain: close those first")


def explain(state: OnboardState, runtime: Runtime[Context]) -> dict:
    explanations = state.get("explanations", [])
    if not any(e.status == "pending" for e in explanations):
        return {}
    if final_report(state["report"], state["tasks"]).summary["gaps_remain"]:
        return {"explanations": [e.model_copy(update=dict(status="open", failures=[GAPS_FIRST]))
                                 if e.status == "pending" else e for e in explanations]}
    spec, steps, done = state["spec"], list(state.get("spec_steps", [])), []
    for e in explanations:
        if e.status == "pending":
            e, spec, steps = _explain_one(state, runtime.context, e, spec, steps)
        done.append(e)
    if spec is state["spec"]:
        return {"explanations": done}
    o = state["options"]
    report = gap_analysis(spec, manifest(o.model_dir), o.gpu_mem_gib, o.lora_rank, o.seq_len)
    return {"explanations": done, "spec": spec, "spec_steps": steps, "report": report}


def _explain_one(state: OnboardState, context: Context, e: Explanation, spec, steps: list):
    """(the explanation, accepted or refused; the spec with it applied when accepted, and the steps to it)."""
    try:
        proposal = context.llm.ask(explaining.prompt(e, spec), Proposal, f"explain {e.item}")
    except LLMError as err:
        return e.model_copy(update=dict(status="refused", failures=[Failure(check="llm", detail=str(err))])), spec, steps
    applied = explaining.apply(spec, proposal, e.value)
    if isinstance(applied, Failure):
        return e.model_copy(update=dict(status="refused", proposal=proposal, failures=[applied])), spec, steps
    step = explaining.step_for(proposal, e.value)
    trial_steps = steps if step is None else [*steps, step]
    folder = context.run_dir / "trials" / f"explain-{''.join(c if c.isalnum() else '_' for c in e.item)}"
    generated = [t.accepted for t in state["tasks"] if t.accepted is not None]
    failures, tiers = trial_failures(state, generated, trial_steps, folder, context)
    verdict = "refused" if failures else "accepted"
    context.progress(f"explain: {e.item!r} as {proposal.op}{'.' + proposal.parameter if proposal.parameter else ''}: "
                     f"{verdict}" + (f" ({failures[0].check})" if failures else ""))
    update = dict(status=verdict, proposal=proposal, failures=failures, evidence={"tiers": tiers})
    return e.model_copy(update=update), *((spec, steps) if failures else (applied, trial_steps))
