"""Gaps -> tasks (agents/tasks.py): every kind with a runtime slot becomes a task; it needs an LLM where the
model's own implementation is there to validate against, else a person, saying why."""
from __future__ import annotations

import copy

from agents.tasks import tasks_for
from runtime.spec import ModelSpec


def _spec(example_spec, family: str, edit) -> ModelSpec:
    data = copy.deepcopy(example_spec(family))
    for layer in data["layers"]:
        edit(layer)
    return ModelSpec.model_validate(data)


def test_a_rope_type_and_a_decay_outside_the_runtime_need_a_person(example_spec):
    def edit(layer):
        attention = layer["attention"]
        if attention.get("rope"):
            attention["rope"]["scaling"] = {"rope_type": "longrope"}
        if attention["kind"] == "gated_delta":
            attention["decay"] = "exp_softplus"

    tasks = {(t.kind, t.name): t for t in tasks_for(_spec(example_spec, "qwen3_next", edit))}
    assert set(tasks) == {("rope", "longrope"), ("linear_attention_decay", "exp_softplus")}
    for task in tasks.values():
        assert task.needs == "person" and task.status == "missing"
        assert "no implementation of" in task.failures[0].detail and "to validate a candidate against" in task.failures[0].detail
    assert tasks[("linear_attention_decay", "exp_softplus")].closes == {"gated_delta_rule": [0, 1, 2]}


def test_a_router_scoring_transformers_names_needs_an_llm(example_spec):
    def edit(layer):
        if layer["ffn"]["kind"] == "moe":
            layer["ffn"]["router"]["scoring"] = "sqrtsoftplus"

    [task] = tasks_for(_spec(example_spec, "deepseek_v3", edit))
    assert (task.kind, task.name, task.needs, task.status) == ("router_scoring", "sqrtsoftplus", "llm", "pending")
    assert task.reference == "transformers.activations:ACT2FN['sqrtsoftplus']"
