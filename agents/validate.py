"""Validation of a candidate against the model's own implementation, the candidate confined in the sandbox.

Static rules first (agents/code_rules.py). Then 5 seeds of fuzzed inputs (from a salt the LLM never sees),
each in fp32 and bf16: the parent computes the reference in fp64 on the same (rounded) inputs, the
sandboxed child only runs the candidate (agents/harness.py) and writes its outputs to files, and the parent
compares: a plain tensor of the right shape and dtype, finite, deterministic, inputs not mutated, not
constant, forward and input gradients within runtime/tolerances.py.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from onboard import model_references
from runtime.tolerances import compare, tolerance_for

from agents import code_rules
from agents.op_kinds import KINDS
from agents.sandbox import Limits, run_python
from agents.state import Candidate, Failure, OpTask

NUM_SEEDS = 5
DTYPES = (torch.float32, torch.bfloat16)
HARNESS = Path(__file__).with_name("harness.py")
GOLDEN_SIZE = 8  # per dimension, for the unit test rendered beside the candidate
STDERR_TAIL = 1500


@dataclass
class Case:
    path: Path
    dtype: torch.dtype
    inputs: dict[str, torch.Tensor]
    expected: torch.Tensor
    grads: dict[str, torch.Tensor]


@dataclass
class Verdict:
    failures: list[Failure]
    evidence: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.failures


def validate(task: OpTask, candidate: Candidate, workdir: Path, salt: int, limits: Limits = Limits(wall_s=90)) -> Verdict:
    problems = code_rules.violations(candidate.source)
    if problems:
        return Verdict([Failure(check="ast", detail="; ".join(problems))])
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    (workdir / "candidate.py").write_text(candidate.source)
    harness = Path(shutil.copy(HARNESS, workdir / HARNESS.name))
    reference = model_references.reference(task.kind, task.name)
    cases = [_case(task, reference, workdir, seed, salt, dtype) for seed in range(NUM_SEEDS) for dtype in DTYPES]
    result = run_python(harness, workdir, ["candidate.py", *[c.path.name for c in cases]], limits)
    if result.timed_out:
        return Verdict([Failure(check="timeout", metric="wall_s", value=result.wall_s, tolerance=limits.wall_s)])
    if result.returncode != 0:
        return Verdict([Failure(check="crash", metric="returncode", value=result.returncode,
                                detail=result.stderr[-STDERR_TAIL:])])
    failures = [f for case in cases for f in _compare(task, case)]
    evidence = {"seeds": NUM_SEEDS, "dtypes": [str(d).removeprefix("torch.") for d in DTYPES],
                "sandbox": result.mode, "wall_s": round(result.wall_s, 2), "worst": _worst(task, cases)}
    return Verdict(failures[:8], evidence)


def _case(task: OpTask, reference, workdir: Path, seed: int, salt: int, dtype: torch.dtype) -> Case:
    gen = torch.Generator().manual_seed(salt + seed)
    inputs = {k: v.to(dtype) for k, v in KINDS[task.kind].make_inputs(gen).items()}
    expected, grads, cotangent = reference_outputs(task, reference, inputs, seed + salt)
    path = workdir / f"case{seed}_{str(dtype).removeprefix('torch.')}.pt"
    torch.save({"inputs": inputs, "cotangent": cotangent}, path)
    return Case(path, dtype, inputs, expected, grads)


def reference_outputs(task: OpTask, reference, inputs: dict, seed: int):
    """The reference in fp64 on the candidate's (rounded) inputs: output, input gradients, the cotangent."""
    leaves = {k: v.double().requires_grad_(True) for k, v in inputs.items()}
    out = KINDS[task.kind].call_reference(reference, leaves)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 7919), dtype=torch.float64)
    (out * cotangent).sum().backward()
    return out.detach(), {k: v.grad for k, v in leaves.items() if v.grad is not None}, cotangent


def _compare(task: OpTask, case: Case) -> list[Failure]:
    dtype = str(case.dtype).removeprefix("torch.")
    try:
        result = torch.load(case.path.with_suffix(".out.pt"), weights_only=True)
    except Exception as err:  # whatever the child wrote, the parent only reports it
        return [Failure(check="output", dtype=dtype, detail=f"unreadable result: {type(err).__name__}: {err}")]
    out = result.get("out")
    shape_problem = _shape_problem(out, result, case)
    if shape_problem:
        return [Failure(check="output", dtype=dtype, detail=shape_problem)]
    checks = [_property("finite", bool(torch.isfinite(out).all()), dtype, "non-finite values in the output"),
              _property("deterministic", torch.equal(out, result["again"]), dtype, "two calls on the same input differ"),
              _property("inputs", all(torch.equal(result["after"][k], v) for k, v in case.inputs.items()), dtype,
                        "an input was modified in place"),
              _property("constant", not (case.expected.std() > 0 and out.double().std() == 0), dtype,
                        "the output is constant where the reference's is not")]
    failures = [f for f in checks if f is not None]
    if failures:
        return failures
    return _numeric(task.kind, out, case.expected, "forward", case.dtype, "out") + [
        f for name, grad in case.grads.items()
        for f in _numeric(task.kind, result["grads"].get(name), grad, f"grad:{name}", case.dtype, "grad")]


def _shape_problem(out, result: dict, case: Case) -> str:
    if type(out) is not torch.Tensor or result.get("type") != "Tensor":
        return f"op returned {result.get('type')}, expected a plain torch.Tensor"
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
        result = torch.load(case.path.with_suffix(".out.pt"), weights_only=True)
        pairs = [("out", result["out"], case.expected)] + [("grad", result["grads"].get(k), g) for k, g in case.grads.items()]
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
