"""parse, recognize, analyze: the release read, recognized into a ModelSpec and judged against the registry."""
from __future__ import annotations

import functools
import random
from pathlib import Path

from langgraph.runtime import Runtime

from onboard.gap.report import analyze as gap_analysis
from onboard.recognize.recognizer import recognize as recognize_spec
from onboard.release.manifest import read_manifest

from agents.context import Context
from agents.explain import explanations_for
from agents.state import OnboardState
from agents.tasks import tasks_for, without_llm


@functools.lru_cache(maxsize=2)
def manifest(model_dir: str):
    return read_manifest(Path(model_dir))


def parse(state: OnboardState) -> dict:
    """Reads and validates the files (a malformed one raises the one-line error the CLI turns into exit 2)."""
    manifest(state["options"].model_dir)
    return {}


def recognize(state: OnboardState) -> dict:
    return {"spec": recognize_spec(manifest(state["options"].model_dir))}


def analyze(state: OnboardState, runtime: Runtime[Context]) -> dict:
    o, spec = state["options"], state["spec"]
    report = gap_analysis(spec, manifest(o.model_dir), o.gpu_mem_gib, o.lora_rank, o.seq_len)
    tasks = tasks_for(spec)
    if runtime.context.llm is None:
        tasks = [without_llm(t) for t in tasks]
    for t in tasks:
        runtime.context.progress(f"gap: {t.kind} {t.name!r} ({', '.join(t.closes)}): needs {t.needs}")
    explanations = explanations_for(report, manifest(o.model_dir).config, runtime.context.llm is not None)
    for e in explanations:
        runtime.context.progress(f"unrecognized: {e.item!r} ({e.source}): needs {e.needs}")
    return {"report": report, "tasks": tasks, "explanations": explanations,
            "validation_salt": random.SystemRandom().randrange(2**31)}
