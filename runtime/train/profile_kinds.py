"""Profiler entry name -> the op kind it belongs to, for per-op time breakdowns of a training step.

Names are CUDA kernel names (GPU profiles) or aten op names (CPU profiles); the first kind whose
fragment occurs in the lower-cased name wins, the rest is "other".
"""
from __future__ import annotations

KINDS = (
    ("gdn/kda kernels", ("prep_blocked", "prep_kernel", "scan_kernel", "scan_bwd", "state_grad", "wy_grad", "diag_token",
                         "gram_grad", "dg_finish", "solve_triangular")),
    ("moe grouped gemm + routing", ("grouped", "down_gemm", "wgrad", "_router", "gather", "combine", "glu", "swiglu",
                                    "topk")),
    ("attention (sdpa)", ("flash", "fmha", "cudnn", "attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "aten::mm", "aten::bmm", "aten::addmm", "aten::matmul",
                "aten::linear")),
    ("loss (chunked lm head + ce)", ("cross_entropy", "crossentropy", "log_softmax", "softmax", "logsumexp", "nll")),
    ("conv1d", ("conv",)),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    # "nocast" is in the name of every TensorIterator elementwise kernel: copies are named by "copy" alone
    ("copies / casts", ("copy", "memcpy", "catarray", "aten::cat", "to_copy")),
    ("elementwise / reductions", ("elementwise", "vectorized", "reduce", "unrolled", "fill", "aten::")),
)


def op_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, keys in KINDS if any(k in lower for k in keys)), "other")
