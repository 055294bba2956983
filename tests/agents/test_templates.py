"""Every candidate template, filled the way an answer would fill it, renders into code that passes the static
rules and computes the intended math on its kind's fuzzed inputs (compared here with an independent form)."""
from __future__ import annotations

import runpy

import pytest
import torch
import torch.nn.functional as F

from agents import code_rules
from agents.candidates import CandidateAnswer, Constant, render
from agents.op_kinds import KINDS
from agents.state import OpTask
from reference_ops.norms import rms_norm


def _rope(i):
    angles = i["positions_T"][:, None] * (i["inv_freq_R"][None, :] / 4.0)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


CASES = {
    "activation": ("F.gelu(x, approximate='tanh')", {}, lambda i: F.gelu(i["x"], approximate="tanh")),
    "router_scoring": ("torch.sqrt(F.softplus(logits_TE))", {}, lambda i: F.softplus(i["logits_TE"]).sqrt()),
    "norm": ("x.pow(2).mean(-1, keepdim=True)", {"EPS": 1e-6, "CENTER": 0, "WEIGHT_OFFSET": 1.0},
             lambda i: rms_norm(i["x_TD"], i["weight_D"], 1e-6, offset=1.0)),
    "rope": ("inv_freq_R / 4.0", {}, _rope),
    "linear_attention_decay": ("F.softplus(z)", {},
                               lambda i: -i["A_log_H"].exp() * F.softplus(i["a_BTH"] + i["dt_bias_H"])),
    "residual_mixing": ("2.0 * sublayer_BTD", {"ALPHA": 0.5}, lambda i: 0.5 * i["skip_BTD"] + 2.0 * i["sublayer_BTD"]),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_template_renders_code_that_computes_its_op(kind, tmp_path):
    expression, constants, expected = CASES[kind]
    task = OpTask(kind=kind, name="test", closes={}, reference=None, needs="llm")
    answer = CandidateAnswer(template=kind, expression=expression,
                             constants=[Constant(name=k, value=v) for k, v in constants.items()])
    candidate = render(task, answer)
    assert code_rules.violations(candidate.source) == []
    (tmp_path / "candidate.py").write_text(candidate.source)
    module = runpy.run_path(str(tmp_path / "candidate.py"))
    assert (module["KIND"], module["NAME"]) == (kind, "test")
    for seed in range(3):
        inputs = KINDS[kind].make_inputs(torch.Generator().manual_seed(seed))
        # fp64 inputs: the math is checked here, precision by validation (templates may compute in fp32)
        torch.testing.assert_close(module["op"](**inputs).double(), expected(inputs), rtol=1e-5, atol=1e-6)


def test_a_template_missing_a_constant_is_refused_by_strict_undefined():
    task = OpTask(kind="norm", name="test", closes={}, reference=None, needs="llm")
    failure = render(task, CandidateAnswer(template="norm", expression="x.pow(2).mean(-1, keepdim=True)"))
    assert failure.check == "template" and "CENTER" in failure.detail
