"""Inputs and the comparison of the GDN/KDA Triton kernels (runtime/ops/gated_delta) against the fp64
references, shared by the test_kernel_gated_delta*.py and test_kernel_kda_diagonal.py files (a helper
module, not a test file).

Shape legend: B batch, T tokens, H heads, K key dim, V value dim, N packed sequences.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from reference_ops.gated_delta import gated_delta_rule as ref_gdn
from reference_ops.kda import kda as ref_kda
from runtime.ops.gated_delta import kernel as kernels
from runtime.tolerances import assert_close

NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
# three packed sequences: one shorter than a sub-chunk, one spanning two chunks of 32
CU_SEQLENS = [0, 5, 40, 63]
# the op-level cases: id -> (make_inputs' arguments, the op's)
CASES = {
    "T63-initial-state": ({}, {}),
    "cu_seqlens": ({"num_states": 3}, {"cu_seqlens": torch.tensor(CU_SEQLENS)}),
    # B=2 folded into time, no qk l2norm, an explicit scale, decays up to ~-15 per token
    "batch2-no-l2norm-strong-decay": ({"B": 2, "T": 40, "decay": 15.0}, {"use_qk_l2norm": False, "scale": 0.3}),
}


def ops():
    """kind -> (op name in runtime/tolerances, fp64 reference, kernel)."""
    return {"gdn": ("gated_delta_rule", ref_gdn, kernels.gated_delta_rule), "kda": ("kda", ref_kda, kernels.kda)}


def make_inputs(kind, B=1, T=63, H=2, K=16, V=32, num_states=None, decay=1.0, seed=0):
    """fp32 inputs as the models make them (g = decay * logsigmoid(.), beta = sigmoid(.)); one initial state
    per sequence."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    g_shape = (B, T, H, K) if kind == "kda" else (B, T, H)
    return {
        "q": rand(B, T, H, K), "k": rand(B, T, H, K), "v": rand(B, T, H, V),
        "g": decay * F.logsigmoid(rand(*g_shape) + 1.0), "beta": torch.sigmoid(rand(B, T, H)),
        "h0": rand(num_states or B, H, K, V),
    }


def outputs_and_grads(fn, x, dtype, **kw):
    """[o, final_state, dq, dk, dv, dg, dbeta, dh0] with fixed random cotangents."""
    leaves = {n: t.to(dtype).detach().requires_grad_() for n, t in x.items()}
    o, s = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state_BHKV=leaves["h0"], **kw)
    gen = torch.Generator().manual_seed(7)
    loss = (o * torch.randn(o.shape, generator=gen).to(o.device, o.dtype)).sum()
    loss = loss + (s * torch.randn(s.shape, generator=gen).to(s.device, s.dtype)).sum()
    loss.backward()
    return [o, s] + [leaves[n].grad for n in ("q", "k", "v", "g", "beta", "h0")]


def check(kind, x, dtype=torch.float32, **kw):
    """The kernel's outputs and gradients in dtype against the fp64 reference at dtype's tolerance. The reference
    sees the same (dtype-rounded) inputs: the bar bounds the kernel's error, not the rounding of its inputs."""
    op, ref, kernel = ops()[kind]
    expected = outputs_and_grads(ref, {n: t.to(dtype) for n, t in x.items()}, torch.float64, **kw)
    actual = outputs_and_grads(kernel, x, dtype, **kw)
    for name, a, e in zip(NAMES, actual, expected):
        assert_close(a, e, op, dtype, kind="out" if name in ("o", "final_state") else "grad", name=name)


def check_case(kind, case):
    """check() on one of CASES, fp32 inputs."""
    inputs, kw = CASES[case]
    check(kind, make_inputs(kind, **inputs), **kw)
