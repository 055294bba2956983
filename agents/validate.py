"""Validation of a candidate against the model's own implementation, the candidate confined in the sandbox.

Static rules first (agents/code_rules.py), as a filter only: the verdict does not rest on them. The candidate
then runs in a sandboxed process of its own (agents/harness.py) that this process talks to through pipes and
never imports: it loads the candidate under each of several `sys.argv`s (as `new-model`, `onboard train` and
torchrun's trainer run), and only after each load does this process draw fresh inputs, from seeds of its own
that exist nowhere before (a shape, values and a cotangent per case, in fp32 and bf16), send them over, and
read back plain tensors (safetensors). The reference (fp64, on the same rounded inputs) and the comparison run
here: a plain tensor of the right shape and dtype, finite, deterministic, inputs not mutated, not constant,
forward and input gradients within runtime/tolerances.py. What the candidate does in its own process (patching
torch.save, reading its argv or environment) cannot reach this verdict; what it could still tell apart (that
it runs in a sandbox) is caught where the op runs: `train` spot-checks every generated op against its reference
on the first step's real inputs (runtime/package_ops.py).
"""
from __future__ import annotations

import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from onboard.recognize import model_references
from runtime.tolerances import compare, tolerance_for

from agents import code_rules
from agents.candidate_channel import Channel, ChildGone
from agents.op_kinds import KINDS
from agents.state import Candidate, Failure, OpTask
from onboard.sandbox.run import Limits, start_python

NUM_SEEDS = 5
DTYPES = (torch.float32, torch.bfloat16)
HARNESS = Path(__file__).with_name("harness.py")
GOLDEN_SIZE = 8  # per dimension, for the unit test rendered beside the candidate
STDERR_TAIL = 1500
# the command lines the candidate is loaded under, each for a share of the cases: the check runs the op as
# `new-model` does and as both ways of training do, so an op that reads its argv is wrong in at least one
ARGVS = (["onboard", "new-model", "MODEL_DIR", "--out", "PKG"],
         ["onboard", "train", "PKG", "--data", "data.jsonl"],
         ["/usr/lib/python3/site-packages/onboard/commands/train.py", "PKG", "--data", "data.jsonl"])


@dataclass
class Case:
    seed: int
    dtype: torch.dtype
    inputs: dict[str, torch.Tensor]
    expected: torch.Tensor
    grads: dict[str, torch.Tensor]
    cotangent: torch.Tensor
    result: dict = field(default_factory=dict)  # the child's tensors: out, again, after.<input>, grad.<input>
    returned_type: str = ""


@dataclass
class Verdict:
    failures: list[Failure]
    evidence: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.failures


def validate(task: OpTask, candidate: Candidate, workdir: Path, salt: int, limits: Limits = Limits(wall_s=90)) -> Verdict:
    """`salt` seeds only the golden test beside the candidate (golden()); the cases here draw fresh seeds."""
    problems = code_rules.violations(candidate.source)
    if problems:
        return Verdict([Failure(check="ast", detail="; ".join(problems))])
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    (workdir / "candidate.py").write_text(candidate.source)
    harness = Path(shutil.copy(HARNESS, workdir / HARNESS.name))
    reference = model_references.reference(task.kind, task.name)
    cases, gone = [], None
    with start_python(harness, workdir, ["candidate.py"], limits) as child:
        try:
            _exchange(task, reference, Channel(child.stdin, child.stdout), cases)
        except ChildGone as err:
            gone = str(err)
    result = child.result
    if result.timed_out:
        return Verdict([Failure(check="timeout", metric="wall_s", value=result.wall_s, tolerance=limits.wall_s)])
    if gone is not None:
        return Verdict([Failure(check="crash", metric="returncode", value=result.returncode,
                                detail=f"{gone}; {result.stderr[-STDERR_TAIL:]}")])
    failures = [f for case in cases for f in _compare(task, case)]
    evidence = {"seeds": NUM_SEEDS, "case_seeds": [c.seed for c in cases],
                "dtypes": [str(d).removeprefix("torch.") for d in DTYPES],
                "argvs": len(ARGVS), "sandbox": result.mode, "wall_s": round(result.wall_s, 2),
                "worst": _worst(task, cases)}
    return Verdict(failures[:8], evidence)


def _exchange(task: OpTask, reference, channel: Channel, cases: list[Case]) -> None:
    """Load the candidate under each argv, then draw, send and collect that argv's share of the cases."""
    plan = [dtype for _ in range(NUM_SEEDS) for dtype in DTYPES]
    for index, argv in enumerate(ARGVS):
        channel.send({"do": "load", "argv": argv})
        if not channel.receive()[0].get("ready"):
            raise ChildGone("the candidate did not load")
        for dtype in plan[index::len(ARGVS)]:
            # drawn now, after the candidate is loaded: nothing in it can have seen these seeds
            case = _case(task, reference, secrets.randbits(62), dtype)
            channel.send({"do": "case"}, {**{f"input.{k}": v for k, v in case.inputs.items()},
                                          "cotangent": case.cotangent})
            header, case.result = channel.receive()
            case.returned_type = str(header.get("type", ""))
            cases.append(case)
    channel.send({"do": "exit"})


def _case(task: OpTask, reference, seed: int, dtype: torch.dtype) -> Case:
    gen = torch.Generator().manual_seed(seed)
    inputs = {k: v.to(dtype) for k, v in KINDS[task.kind].make_inputs(gen).items()}
    expected, grads, cotangent = reference_outputs(task, reference, inputs, seed)
    return Case(seed, dtype, inputs, expected, grads, cotangent)


def reference_outputs(task: OpTask, reference, inputs: dict, seed: int):
    """The reference in fp64 on the candidate's (rounded) inputs: output, input gradients, the cotangent."""
    leaves = {k: v.double().requires_grad_(True) for k, v in inputs.items()}
    out = KINDS[task.kind].call_reference(reference, leaves)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 7919), dtype=torch.float64)
    (out * cotangent).sum().backward()
    return out.detach(), {k: v.grad for k, v in leaves.items() if v.grad is not None}, cotangent


def _compare(task: OpTask, case: Case) -> list[Failure]:
    dtype = str(case.dtype).removeprefix("torch.")
    unexpected = _unexpected_tensors(case)
    if unexpected:
        return [Failure(check="output", dtype=dtype, detail=unexpected)]
    out, result = case.result.get("out"), case.result
    shape_problem = _shape_problem(out, case)
    if shape_problem:
        return [Failure(check="output", dtype=dtype, detail=shape_problem)]
    again = result.get("again")
    checks = [_property("finite", bool(torch.isfinite(out).all()), dtype, "non-finite values in the output"),
              _property("deterministic", again is not None and torch.equal(out, again), dtype,
                        "two calls on the same input differ"),
              _property("inputs", all(_same(result.get(f"after.{k}"), v) for k, v in case.inputs.items()), dtype,
                        "an input was modified in place"),
              _property("constant", not (case.expected.std() > 0 and out.double().std() == 0), dtype,
                        "the output is constant where the reference's is not")]
    failures = [f for f in checks if f is not None]
    if failures:
        return failures
    return _numeric(task.kind, out, case.expected, "forward", case.dtype, "out") + [
        f for name, grad in case.grads.items()
        for f in _numeric(task.kind, result.get(f"grad.{name}"), grad, f"grad:{name}", case.dtype, "grad")]


def _unexpected_tensors(case: Case) -> str:
    allowed = {"out", "again", *(f"{w}.{k}" for k in case.inputs for w in ("after", "grad"))}
    extra = sorted(set(case.result) - allowed)
    return f"the candidate's process returned tensors nobody asked for: {extra}" if extra else ""


def _same(after, before: torch.Tensor) -> bool:
    return after is not None and after.dtype == before.dtype and torch.equal(after, before)


def _shape_problem(out, case: Case) -> str:
    if out is None or case.returned_type != "Tensor":
        return f"op returned {case.returned_type}, expected a plain torch.Tensor"
    if tuple(out.shape) != tuple(case.expected.shape):
        return f"output shape {tuple(out.shape)}, expected {tuple(case.expected.shape)}"
    if out.dtype != case.dtype:
        return f"output dtype {out.dtype}, expected {case.dtype} (the input's)"
    return ""


def _property(check: str, holds: bool, dtype: str, detail: str) -> Failure | None:
    return None if holds else Failure(check=check, dtype=dtype, detail=detail)


def _numeric(kind: str, actual, expected: torch.Tensor, check: str, dtype: torch.dtype, which: str) -> list[Failure]:
    name = str(dtype).removeprefix("torch.")
    if actual is None or actual.shape != expected.shape:
        return [Failure(check=check, dtype=name, detail="gradient missing or of the wrong shape")]
    result = compare(actual, expected, tolerance_for(kind, dtype, which))
    if result.passed:
        return []
    return [Failure(check=check, metric="rel_rms", value=result.rel_rms, tolerance=result.tolerance.rel_rms, dtype=name,
                    detail=f"max_abs_rel {result.max_abs_rel:.3e} (tolerance {result.tolerance.max_abs_rel:.0e})")]


def _worst(task: OpTask, cases: list[Case]) -> dict:
    """Worst relative RMS error per dtype, forward and gradients, for the evidence."""
    worst: dict[str, float] = {}
    for case in cases:
        if case.result.get("out") is None:
            continue
        pairs = [("out", case.result["out"], case.expected)] + [
            ("grad", case.result.get(f"grad.{k}"), g) for k, g in case.grads.items()]
        for which, actual, expected in pairs:
            if actual is not None and actual.shape == expected.shape:
                key = f"{which}/{str(case.dtype).removeprefix('torch.')}"
                worst[key] = max(worst.get(key, 0.0), compare(actual, expected, tolerance_for(task.kind, case.dtype)).rel_rms)
    return {k: float(f"{v:.3e}") for k, v in sorted(worst.items())}


def golden(task: OpTask, salt: int) -> tuple[dict, list]:
    """Small fixed inputs and the reference's fp64 outputs on them, for the candidate's unit test."""
    inputs = KINDS[task.kind].make_inputs(torch.Generator().manual_seed(salt + NUM_SEEDS))
    small = {k: v[tuple(slice(0, GOLDEN_SIZE) for _ in v.shape)] for k, v in inputs.items()}
    reference = model_references.reference(task.kind, task.name)
    expected, _, _ = reference_outputs(task, reference, small, salt)
    return {k: v.tolist() for k, v in small.items()}, expected.tolist()
