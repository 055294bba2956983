"""The one tolerance table and the one comparison helper used by tests, alignment and benchmarks.

Metric: relative RMS error ||a - e||_2 / ||e||_2 plus max-abs error relative to max|e|.
NaN or Inf in the actual tensor never passes; the expected tensor must be finite.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    rel_rms: float
    # max |a - e| / max |e|: catches a few badly wrong elements that RMS would average away
    max_abs_rel: float


# Per dtype. Observed worst relative RMS errors of the runtime forms vs the fp64 reference on CPU
# (tests/ops/*/test_ref_*.py): fp32 outputs 1e-7..4e-7, grads up to 8.4e-6 (softmax attention);
# bf16 outputs up to 5.7e-3 (MLA), grads up to 8.1e-3 (MLA). On the H200 at benchmark shapes the
# bf16 kernels reached 1.2e-3..3.4e-3 (bench/results/). The bf16 bars are TARGETS.md's 1e-2 / 2e-2.
DEFAULT_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(rel_rms=1e-10, max_abs_rel=1e-9),
    torch.float32: Tolerance(rel_rms=1e-4, max_abs_rel=1e-3),
    torch.bfloat16: Tolerance(rel_rms=1e-2, max_abs_rel=6e-2),
    torch.float16: Tolerance(rel_rms=5e-3, max_abs_rel=3e-2),
}

# Gradients go through one more matmul chain than outputs: TARGETS.md allows 2e-2 in bf16.
GRAD_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(rel_rms=1e-9, max_abs_rel=1e-8),
    torch.float32: Tolerance(rel_rms=5e-4, max_abs_rel=5e-3),
    torch.bfloat16: Tolerance(rel_rms=2e-2, max_abs_rel=1e-1),
    torch.float16: Tolerance(rel_rms=1e-2, max_abs_rel=6e-2),
}

# fp32 Triton kernels on CUDA multiply in TF32 (10-bit mantissa), as tl.dot does by default: a
# decision for speed, not a bug. Worst observed on the H200 at tier-0 shapes with the default kernels
# (bench/results/gpu-tier0.json): GDN out 1.90e-3 rel RMS / 2.21e-3
# max-abs, grads 1.86e-3 / 2.55e-3, KDA 1.4e-3 / 2.36e-3, DSA attention 1.67e-3 / 2.39e-3.
# The bound is about 2.5x the worst observed; the fp32 table still applies on the CPU.
TF32_KERNEL_TOLERANCES: dict[str, Tolerance] = {
    "out": Tolerance(rel_rms=5e-3, max_abs_rel=1e-2),
    "grad": Tolerance(rel_rms=5e-3, max_abs_rel=1e-2),
}

# Per-op overrides, keyed (op, dtype, "out" | "grad"). Each entry says what was observed.
# "model_logits" and "model_loss": alignment tier 2's whole-model bars against transformers' fp32 run
# (the issue's model-level bars): logits in fp32 judged on max-abs within 1e-4 of the logits' max, in
# bf16 on rel RMS within 2e-2 or bf16_logits_bar's scaled bar (its max-abs bar of 1.0 never binds); the loss on
# its relative difference.
OP_TOLERANCES: dict[tuple[str, torch.dtype, str], Tolerance] = {
    ("model_logits", torch.float32, "out"): Tolerance(rel_rms=1e-4, max_abs_rel=1e-4),
    ("model_logits", torch.bfloat16, "out"): Tolerance(rel_rms=2e-2, max_abs_rel=1.0),
    ("model_loss", torch.float32, "out"): Tolerance(rel_rms=1e-5, max_abs_rel=1e-5),
    ("model_loss", torch.bfloat16, "out"): Tolerance(rel_rms=1e-2, max_abs_rel=1e-2),
    # tier 2's training curve (the bar): each of 10 LoRA steps' loss here vs transformers + PEFT,
    # fp32 on CPU, relative difference; observed at most 1.7e-7 on the 12 example families
    ("model_train_loss", torch.float32, "out"): Tolerance(rel_rms=1e-4, max_abs_rel=1e-4),
    # tier 3: a distributed run (gloo, CPU, dp/ep meshes of 2 and 4 ranks) vs one process, fp32, losses and
    # every step's LoRA gradients (norm-relative, against the one-process run with the same rows per expert
    # GEMM); the bar. Observed: losses 1.7e-7, gradients 1.5e-6 (qwen3_moe, 4 steps, dp2 ep2 ep4
    # dp2xep2, ep2 and ep4 with the aux loss)
    ("parallel_train", torch.float32, "out"): Tolerance(rel_rms=1e-5, max_abs_rel=1e-5),
    # chunked LM head + cross-entropy (fp32) vs the plain one in fp64 (tests/runtime/test_loss.py, CPU):
    # loss 3e-8, grads 3.5e-7 rel RMS / 7.2e-7 max-abs: fp32 rounding, held to about 5x that
    ("chunked_cross_entropy", torch.float32, "out"): Tolerance(rel_rms=2e-6, max_abs_rel=5e-6),
    ("chunked_cross_entropy", torch.float32, "grad"): Tolerance(rel_rms=2e-6, max_abs_rel=5e-6),
}


# Tier 2's bf16 logits bar, one rule for registry ops and own modules alike: bf16 rounds every weight and
# activation, so the error a correct bf16 model reaches grows with the release's weights, and transformers' own
# bf16 run against its fp32 run measures it. Ours may be this many times that, and is never held below the
# table's model_logits floor (2e-2): a release whose weights make transformers itself miss 2e-2 is not a
# reason to demote our ops to its modules.
BF16_LOGITS_MARGIN = 1.1


def bf16_logits_bar(transformers_rel_rms: float) -> Tolerance:
    """The bf16 logits tolerance given transformers' own bf16-vs-fp32 rel RMS error on the same inputs."""
    floor = OP_TOLERANCES[("model_logits", torch.bfloat16, "out")]
    return Tolerance(rel_rms=max(floor.rel_rms, BF16_LOGITS_MARGIN * transformers_rel_rms), max_abs_rel=floor.max_abs_rel)


def tolerance_for(op: str, dtype: torch.dtype, kind: str = "out", tf32_kernel: bool = False) -> Tolerance:
    """tf32_kernel: an fp32 run of a Triton kernel on CUDA (see TF32_KERNEL_TOLERANCES)."""
    if tf32_kernel and dtype == torch.float32:
        return TF32_KERNEL_TOLERANCES[kind]
    override = OP_TOLERANCES.get((op, dtype, kind))
    if override is not None:
        return override
    table = GRAD_TOLERANCES if kind == "grad" else DEFAULT_TOLERANCES
    return table[dtype]


@dataclass(frozen=True)
class Comparison:
    rel_rms: float
    max_abs_rel: float
    finite: bool
    tolerance: Tolerance

    @property
    def passed(self) -> bool:
        return (
            self.finite
            and self.rel_rms <= self.tolerance.rel_rms
            and self.max_abs_rel <= self.tolerance.max_abs_rel
        )

    def describe(self) -> str:
        verdict = "ok" if self.passed else "FAIL"
        return (
            f"{verdict}: rel_rms={self.rel_rms:.3e} (tol {self.tolerance.rel_rms:.0e}) "
            f"max_abs_rel={self.max_abs_rel:.3e} (tol {self.tolerance.max_abs_rel:.0e})"
            + ("" if self.finite else " non-finite values")
        )


def compare(actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance) -> Comparison:
    """Compare in fp64. Raises if the expected tensor itself is not finite."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    e = expected.detach().to(torch.float64)
    if not torch.isfinite(e).all():
        raise ValueError("expected (reference) tensor has non-finite values")
    a = actual.detach().to(torch.float64)
    finite = bool(torch.isfinite(a).all())
    if not finite:
        return Comparison(float("inf"), float("inf"), False, tolerance)
    diff = a - e
    scale_rms = e.norm().item()
    scale_max = e.abs().max().item() if e.numel() else 0.0
    rel_rms = diff.norm().item() / scale_rms if scale_rms > 0 else diff.norm().item()
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    max_abs_rel = max_abs / scale_max if scale_max > 0 else max_abs
    return Comparison(rel_rms, max_abs_rel, True, tolerance)


def assert_close(actual, expected, op: str, dtype: torch.dtype | None = None, kind: str = "out", name: str = "") -> Comparison:
    """Test helper: compare with the table entry for (op, dtype, kind) and raise with the numbers."""
    dtype = dtype or actual.dtype
    result = compare(actual, expected, tolerance_for(op, dtype, kind))
    if not result.passed:
        raise AssertionError(f"{op} {kind} {name}: {result.describe()}")
    return result
