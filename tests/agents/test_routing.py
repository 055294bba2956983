"""The graph's routing functions are pure: each is called on hand-made states, no LLM, no files."""
from __future__ import annotations

import re
from pathlib import Path

from agents.graph import after_align, after_analyze, after_assemble, after_generate, after_validate, build
from agents.state import Alignment, Candidate, Demotion, OpTask
from onboard.align.report import Check


def _task(**update) -> OpTask:
    fields = dict(kind="activation", name="relu2", closes={"moe_experts": [0, 1]}, reference="ref", needs="llm")
    return OpTask(**{**fields, **update})


class _Report:
    def __init__(self, gaps: bool):
        self.summary = {"gaps_remain": gaps}


def test_a_pending_task_goes_to_generate_and_none_to_explain():
    assert after_analyze({"tasks": [_task()]}) == "generate"
    assert after_analyze({"tasks": [_task(status="missing")]}) == "explain"
    assert after_analyze({"tasks": []}) == "explain"


def test_a_candidate_goes_to_validate_a_failed_generation_retries_or_gives_up():
    candidate = Candidate(template="activation", source="...")
    assert after_generate({"tasks": [_task(candidate=candidate)]}) == "validate"
    assert after_generate({"tasks": [_task(attempts=1)]}) == "generate"
    assert after_generate({"tasks": [_task(status="missing", attempts=3)]}) == "explain"


def test_after_validation_the_next_pending_task_or_explain():
    done = _task(status="accepted")
    other = OpTask(kind="activation", name="mish", closes={"swiglu_mlp": [2]}, reference="ref", needs="llm")
    assert after_validate({"tasks": [done, other]}) == "generate"
    assert after_validate({"tasks": [done, _task(name="x", status="missing")]}) == "explain"


def test_alignment_runs_only_without_gaps():
    assert after_assemble({"report": _Report(gaps=True)}) == "review"
    assert after_assemble({"report": _Report(gaps=False)}) == "align"


def _failed(tier: int, name: str, layer: int | None) -> Alignment:
    check = Check(tier=tier, name=name, metric="rel_rms", value=0.5, tolerance=1e-4, verdict="fail", layer=layer)
    return Alignment(passed=False, summary="...", failed_tier=tier, failed=[check])


def test_a_failed_alignment_demotes_once_per_rung_then_reviews(seed_spec):
    """A passing package (every example family's) goes to review; no retry runs for it."""
    layers = Demotion(rung="layers", failed=[])
    assert after_align({"spec": seed_spec, "alignment": Alignment(passed=True, summary="ok")}) == "review"
    assert after_align({"spec": seed_spec, "alignment": _failed(1, "layer0:x/out", 0)}) == "demote"
    assert after_align({"spec": seed_spec, "alignment": _failed(1, "layer0:x/out", 0), "demotions": [layers]}) == "demote"
    assert after_align({"spec": seed_spec, "alignment": _failed(2, "logits/float32", None),
                        "demotions": [layers, Demotion(rung="model", failed=[])]}) == "review"
    assert after_align({"spec": seed_spec, "alignment": _failed(2, "training/loss", None)}) == "review"


def test_the_drawing_has_exactly_the_routed_edges():
    mermaid = build().compile().get_graph().draw_mermaid()
    for edge in ("validate -.-> generate", "generate -.-> validate", "analyze -.-> explain", "explain --> plan",
                 "assemble -.-> align", "align -.-> demote", "align -.-> review", "demote --> plan"):
        assert edge in mermaid
    assert "analyze -.-> review" not in mermaid and "analyze -.-> plan" not in mermaid


def test_the_documented_drawing_is_the_graph_as_it_renders():
    page = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    block = re.search(r"```mermaid\n(.*?)```", page, re.DOTALL)
    assert block is not None and block.group(1) == build().compile().get_graph().draw_mermaid()


def test_no_demotion_when_transformers_could_not_build_the_model(seed_spec):
    """Found by the config fuzz through new-model (qwen3_next, rope_parameters.partial_rotary_factor null: its
    config class accepts it, its rotary init fails): tier 1 failed and the demotion asked that model for module
    names (exit 1). Every rung runs transformers' modules, so without its model the package goes to review."""
    from onboard.recognize.meta_check import NOT_BUILT, MetaCheck

    class _Checked(_Report):
        def __init__(self, model_class: str | None):
            super().__init__(gaps=False)
            self.meta_check = model_class and MetaCheck(model_class=model_class, params=0, params_agree=False,
                                                        layer_disagreements=[])
    failed = _failed(1, "layer0:x/out", 0)
    assert after_align({"spec": seed_spec, "alignment": failed, "report": _Checked(NOT_BUILT)}) == "review"
    # a family transformers does not know (an auto_map release of its own design): no meta check, no modules
    assert after_align({"spec": seed_spec, "alignment": failed, "report": _Checked(None)}) == "review"
    assert after_align({"spec": seed_spec, "alignment": failed, "report": _Checked("Qwen3NextForCausalLM")}) == "demote"
