"""Candidates from templates: the LLM's structured answer rendered into a plain-torch module (templates/candidates/),
its unit test, and the prompt that asks for it (templates/prompts/candidate.md.j2)."""
from __future__ import annotations

import ast
from typing import Literal, Optional

import jinja2
from pydantic import BaseModel

from onboard.gap.render import TEMPLATES, jinja_env
from onboard.release.model_source import ModelSource

from agents.op_kinds import KINDS
from agents.state import Candidate, Failure, OpTask

TemplateName = Literal["activation", "router_scoring", "norm", "rope", "linear_attention_decay", "residual_mixing",
                       "free_form"]
# where each template's expression goes, and the constants it reads
HOLES = {"activation": ("x -> the activation", ""), "router_scoring": ("logits_TE -> scores", ""),
         "norm": ("the mean square of x", "EPS, CENTER (0 or 1) and WEIGHT_OFFSET are required"),
         "rope": ("inv_freq_R -> freq", ""), "linear_attention_decay": ("z -> a positive factor", ""),
         "residual_mixing": ("sublayer_BTD -> the added term", "ALPHA is required")}


class Constant(BaseModel):
    name: str
    value: float


class CandidateAnswer(BaseModel):
    """The LLM's structured answer: a template filled in, or a free-form function."""
    template: TemplateName
    expression: Optional[str] = None
    constants: list[Constant] = []
    code: Optional[str] = None
    rationale: str = ""


def prompt(task: OpTask, spec, op_source: Optional[ModelSource], module_source: Optional[ModelSource],
           max_attempts: int) -> str:
    kind = KINDS[task.kind]
    hole, constants_hint = HOLES[task.kind]
    template_text = (TEMPLATES / "candidates" / f"{task.kind}.py.j2").read_text()
    return jinja_env().get_template("prompts/candidate.md.j2").render(
        family=spec.family, architecture=spec.architecture, kind=task.kind, description=kind.description,
        name=task.name, used_by=", ".join(f"{op} (layers {_span(layers)})" for op, layers in task.closes.items()),
        signature=kind.signature, op_source=op_source, module_source=module_source, template_hole=hole,
        constants_hint=constants_hint or "none needed", template_text=template_text.split("%}", 1)[1].lstrip(),
        failures=task.failures, attempt=task.attempts, max_attempts=max_attempts)


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 2 else ", ".join(map(str, layers))


def render(task: OpTask, answer: CandidateAnswer) -> Candidate | Failure:
    """The module source, or the failure that kept it from rendering."""
    names = [c.name for c in answer.constants]
    if any(not n.isidentifier() or not n.isupper() for n in names):
        return Failure(check="template", detail=f"constants must be UPPER_CASE identifiers, got {names}")
    fill = dict(kind=task.kind, name=task.name, constants={c.name: repr(c.value) for c in answer.constants})
    if answer.template == "free_form":
        if not answer.code:
            return Failure(check="template", detail="free_form needs `code`")
        fill["code"] = answer.code
    elif answer.template != task.kind:
        return Failure(check="template", detail=f"template {answer.template!r} does not fit a {task.kind} gap")
    else:
        problem = _expression_problem(answer.expression)
        if problem:
            return Failure(check="template", detail=problem)
        fill["expression"] = answer.expression
    try:
        source = jinja_env().get_template(f"candidates/{answer.template}.py.j2").render(**fill)
    except jinja2.UndefinedError as err:
        return Failure(check="template", detail=f"the template needs {err.message}")
    return Candidate(template=answer.template, source=source, rationale=answer.rationale)


def _expression_problem(expression: Optional[str]) -> str:
    if not expression:
        return "the template needs `expression`"
    try:
        ast.parse(expression, mode="eval")
    except SyntaxError as err:
        return f"expression is not one Python expression ({err.msg})"
    return ""


def unit_test(task: OpTask, file: str, inputs: dict, expected: list) -> str:
    return jinja_env().get_template("candidates/test_candidate.py.j2").render(
        kind=task.kind, name=task.name, reference=task.reference, file=file, inputs=repr(inputs), expected=repr(expected))
