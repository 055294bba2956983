"""generate: ask the LLM for a candidate for the first pending op, the failures of its last one attached."""
from __future__ import annotations

from pathlib import Path

from langgraph.runtime import Runtime

from onboard.recognize import model_references
from onboard.release.model_source import module_source

from agents import candidates
from agents.context import Context
from agents.llm import LLMError
from agents.state import Failure, OnboardState, OpTask


def pending(state: OnboardState) -> OpTask | None:
    return next((t for t in state.get("tasks", []) if t.status == "pending"), None)


def replace(state: OnboardState, task: OpTask, **update) -> list[OpTask]:
    """The task list with `task` updated (tasks are identified by kind and name)."""
    return [t.model_copy(update=update) if (t.kind, t.name) == (task.kind, task.name) else t for t in state["tasks"]]


def refused(task: OpTask, failures: list[Failure], max_attempts: int) -> dict:
    """The update for a refused attempt: missing once the attempts are spent."""
    return dict(failures=failures, history=task.history + [failures], candidate=None,
                status="missing" if task.attempts >= max_attempts else "pending")


def generate(state: OnboardState, runtime: Runtime[Context]) -> dict:
    task, options = pending(state), state["options"]
    attempt = task.attempts + 1
    runtime.context.progress(f"generate: {task.kind} {task.name!r}, attempt {attempt} of {options.max_attempts}")
    module = module_source(Path(options.model_dir), state["spec"].family, next(iter(task.closes)))
    prompt = candidates.prompt(task, state["spec"], model_references.source(task.kind, task.name), module,
                               options.max_attempts)
    try:
        answer = runtime.context.llm.ask(prompt, candidates.CandidateAnswer, f"candidate {task.kind} {task.name} #{attempt}")
    except LLMError as err:
        answer = Failure(check="llm", detail=str(err))
    rendered = candidates.render(task, answer) if isinstance(answer, candidates.CandidateAnswer) else answer
    task = task.model_copy(update=dict(attempts=attempt))
    if isinstance(rendered, Failure):
        return {"tasks": replace(state, task, attempts=attempt, **refused(task, [rendered], options.max_attempts))}
    return {"tasks": replace(state, task, attempts=attempt, candidate=rendered)}
