"""Render a ParallelPlan: plan.yaml through the Jinja template, the terminal through rich."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from onboard.gap.render import jinja_env
from onboard.plan.search import ParallelPlan, PlanCandidate


def alternatives(plan: ParallelPlan) -> list[PlanCandidate]:
    """The best candidate of every mesh, in the plan's ranking order."""
    best: dict[str, PlanCandidate] = {}
    for candidate in plan.candidates:
        best.setdefault(candidate.mesh, candidate)
    return list(best.values())


def plan_yaml(plan: ParallelPlan) -> str:
    chosen = plan.chosen.model_dump() if plan.chosen else None
    rows = [dict(a.model_dump(), mesh=a.mesh) for a in alternatives(plan)]
    return jinja_env().get_template("plan.yaml.j2").render(p=plan.model_dump(), c=chosen, alternatives=rows)


def breakdown(c: PlanCandidate) -> str:
    """One line: where a candidate's per-rank memory goes, and its step time."""
    m, t = c.memory, c.time
    return (f"{c.mesh} ({c.experts_per_rank} experts/rank), {c.policy}, micro-batch {c.micro_batch}: per rank "
            f"weights {m.weights:.1f} (experts {m.experts:.1f}) + LoRA {m.lora:.2f} + activations {m.activations:.1f} + all-to-all {m.all_to_all:.1f} "
            f"+ all-gather {m.all_gather:.1f} + workspace {m.workspace:.1f} = {m.total:.1f} GiB of {m.capacity:.1f}; "
            f"step {t.step:.2f} s (compute {t.compute:.2f}, exposed comm {t.exposed:.2f}, overlapped {t.overlapped:.2f}), "
            f"{t.tokens_per_s:,.0f} tokens/s")


def print_plan(plan: ParallelPlan, console: Console | None = None) -> None:
    # no automatic highlighting: rich's repr highlighter runs regexes that take time quadratic in a
    # line's length over text that comes from the release (a long name hung the command)
    console = console or Console(width=None if Console().is_terminal else 160, highlight=False)
    table = Table(title=f"{plan.model} on {plan.gpus} GPUs of {plan.gpu_mem_gib:g} GiB (seq {plan.seq_len}); base "
                        f"weights as {plan.weights_as}")
    for column in ("mesh", "experts/rank", "policy", "mb", "weights", "act", "a2a", "gather", "total GiB",
                   "step s", "tokens/s", "verdict"):
        table.add_column(column)
    # one mesh asked for: all its candidates; otherwise the best of each mesh
    rows = plan.candidates if len(alternatives(plan)) == 1 else alternatives(plan)
    for a in rows:
        m, t = a.memory, a.time
        sizes = [f"{x:.1f}" for x in (m.weights, m.activations, m.all_to_all, m.all_gather, m.total)] if m else ["-"] * 5
        speed = [f"{t.step:.2f}", f"{t.tokens_per_s:,.0f}"] if t and a.fits else ["-", "-"]
        verdict = f"[green]{a.reason}[/]" if a.fits else f"[red]{a.reason}[/]"
        table.add_row(a.mesh, str(a.experts_per_rank), a.policy, str(a.micro_batch), *sizes, *speed, verdict)
    console.print(table)
    if plan.chosen:
        console.print(f"[bold]chosen[/] {breakdown(plan.chosen)}")
    else:
        console.print(f"[red]{plan.reason}[/]")
        if plan.smallest_gpus:
            console.print(f"smallest GPU count that fits: {plan.smallest_gpus} GPUs")
        else:
            console.print("no GPU count fits: a rank's activations, buffers and workspace do not shrink with more GPUs")
