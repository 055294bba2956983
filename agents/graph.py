"""The onboarding graph: parse -> recognize -> analyze -> (generate <-> validate)* -> explain -> plan -> assemble
-> align (-> demote -> plan -> assemble -> align)* -> review.

A candidate that validation refuses goes back to generate with the failure evidence, at most
`max_attempts` times per op (a counter in the state), then the op stays missing with that evidence.
explain asks the LLM what each unrecognized config key is, once the ops are settled (tiers 0-1 confirm it).
A failed alignment demotes to the release's own modules where ours disagree (onboard/review/demotion.py: the
failing layer kinds, then the whole model), each rung at most once, and is assembled and aligned again.
Routing functions are pure: they read the state and return the next node's name. The run is
checkpointed after every node (SQLite in the run folder beside PKG, durability "sync"), so
`new-model --resume` after a crash continues at the node that was running.
"""
from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path
from typing import Callable, Literal

from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph

from onboard.errors import BadInput
from onboard.package.writer import check_out, locked, made_parents

from agents.context import Context
from agents.llm import LLMClient
from agents.nodes.check import validate
from agents.nodes.explain import explain
from agents.nodes.demote import demote, rung
from agents.nodes.generate import generate, pending
from agents.nodes.package import align, assemble, plan, review
from agents.nodes.understand import analyze, parse, recognize
from agents.state import SERIALIZED_TYPES, OnboardState, RunOptions

THREAD = {"configurable": {"thread_id": "onboard"}}


def after_analyze(state: OnboardState) -> Literal["generate", "explain"]:
    return "generate" if pending(state) else "explain"


def after_generate(state: OnboardState) -> Literal["validate", "generate", "explain"]:
    task = pending(state)
    if task is not None and task.candidate is not None:
        return "validate"
    return "generate" if task is not None else "explain"


def after_validate(state: OnboardState) -> Literal["generate", "explain"]:
    return "generate" if pending(state) else "explain"


def after_assemble(state: OnboardState) -> Literal["align", "review"]:
    return "review" if state["report"].summary["gaps_remain"] else "align"


def after_align(state: OnboardState) -> Literal["demote", "review"]:
    """A failed alignment demotes to the release's own modules, one rung at a time, each at most once."""
    return "review" if rung(state) is None else "demote"


def build() -> StateGraph:
    graph = StateGraph(OnboardState, context_schema=Context)
    for name, node in [("parse", parse), ("recognize", recognize), ("analyze", analyze), ("generate", generate),
                       ("validate", validate), ("explain", explain), ("plan", plan), ("assemble", assemble), ("align", align),
                       ("demote", demote), ("review", review)]:
        graph.add_node(name, node)
    graph.add_edge(START, "parse")
    graph.add_edge("parse", "recognize")
    graph.add_edge("recognize", "analyze")
    graph.add_conditional_edges("analyze", after_analyze)
    graph.add_conditional_edges("generate", after_generate)
    graph.add_conditional_edges("validate", after_validate)
    graph.add_edge("explain", "plan")
    graph.add_edge("plan", "assemble")
    graph.add_conditional_edges("assemble", after_assemble)
    graph.add_conditional_edges("align", after_align)
    graph.add_edge("demote", "plan")
    graph.add_edge("review", END)
    return graph


def run_dir(out: Path) -> Path:
    """The run's working folder, beside PKG (which appears only when assemble renames it into place)."""
    out = Path(out).absolute()
    return out.parent / f".{out.name}.run"


def run(options: RunOptions, resume: bool = False, progress: Callable[[str], None] = print) -> OnboardState:
    """Run (or resume) the graph for one release; the final state, with `exit_code`."""
    folder = run_dir(Path(options.out))
    # the release and --out are checked before any node runs; a second run on one --out waits for nobody
    check_out_if_new(Path(options.out), Path(options.model_dir), folder)
    with made_parents(folder.parent), locked(folder):
        return _run_locked(options, resume, progress, folder)


def check_out_if_new(out: Path, model_dir: Path, folder: Path) -> None:
    if not folder.exists():
        check_out(out.absolute(), model_dir.resolve())


def _run_locked(options: RunOptions, resume: bool, progress: Callable[[str], None], folder: Path) -> OnboardState:
    checkpoint = folder / "checkpoint.sqlite"
    if Path(options.out).exists() and not folder.exists():
        raise BadInput(Path(options.out), None, "package folder already exists; choose another --out or remove it")
    if resume and not checkpoint.exists():
        raise BadInput(folder, None, "nothing to resume: no checkpoint of an earlier run of this --out")
    if not resume and folder.exists():
        raise BadInput(folder, None, "an earlier run of this --out left its state here: pass --resume or remove it")
    folder.mkdir(parents=True, exist_ok=True)
    # one process, one connection per run folder (SQLite checkpoints are not for concurrent writers)
    connection = sqlite3.connect(checkpoint, check_same_thread=False)
    app = build().compile(checkpointer=SqliteSaver(connection, serde=JsonPlusSerializer(
        allowed_msgpack_modules=SERIALIZED_TYPES)))
    try:
        state = _stream(app, options, resume, folder, progress)
    except BadInput:
        # bad input: nothing worth resuming
        connection.close()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    connection.close()
    # the package holds the LLM log and the evidence; the checkpoint has served its purpose
    shutil.rmtree(folder, ignore_errors=True)
    return state


def _stream(app, options: RunOptions, resume: bool, folder: Path, progress) -> OnboardState:
    if resume:
        options = app.get_state(THREAD).values["options"]
    context = Context(run_dir=folder, llm=_client(options, folder), progress=progress)
    for update in app.stream(None if resume else {"options": options}, THREAD, context=context,
                             durability="sync", stream_mode="updates"):
        for node in update:
            progress(f"node {node}: done")
    return app.get_state(THREAD).values


def _client(options: RunOptions, folder: Path) -> LLMClient | None:
    if options.llm_url is None:
        return None
    return LLMClient(options.llm_url, options.llm_model, folder / "llm.jsonl")
