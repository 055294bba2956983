"""GDN's wy_grad step alone: its inputs at a given shape (state_grad_problem's, with state_grad's scratch written by
the Triton kernel) and its outputs from the Triton kernel or the Gluon one (runtime/ops/gated_delta/gluon/wy_representation_grad.py)
in NaN-filled buffers, for test_kernel_gated_delta_hopper_wy.py and device probes (a helper module, not a test file).

Shape legend: T packed tokens, H heads, K key dim, V value dim, NC chunks, NK state_grad's key blocks.
"""
from __future__ import annotations

import contextlib

import torch

from runtime.ops.common import buffers
from runtime.ops.gated_delta import function
from runtime.ops.gated_delta.gluon import wy_representation_grad as hopper_wy
from tests.ops.gated_delta.gated_delta_state_grad import run_state_grad, state_grad_problem, state_grad_scratch

# what wy_grad writes for the scalar decay: dv [T, H, V], the final dq and dk [T, H, K], dbeta and dg [T, H], in the
# inputs' dtype (bf16)
OUTPUTS = ("dv", "dq", "dk", "dbeta", "dg")


def wy_grad_problem(lengths: list[int], H: int, l2norm: bool = True, seed: int = 0, device: str = "cuda") -> dict:
    """state_grad_problem's dict (GDN, K = V = 128) with "scratch": function._grad_scratch after the Triton
    state_grad (what wy_grad reads: the partial dq and dk, dw, dgc's and dgl's slots)."""
    problem = state_grad_problem(lengths, H, l2norm, seed=seed, device=device)
    problem["scratch"] = state_grad_scratch(problem, nan=False)
    run_state_grad(problem, problem["scratch"], gluon=False)
    return problem


@contextlib.contextmanager
def gluon_flag(on: bool):
    """The Gluon kernel where hopper_wy.use_wy_grad allows it (on), or the Triton kernel everywhere (off)."""
    saved = hopper_wy.use_wy_grad
    if not on:
        hopper_wy.use_wy_grad = lambda *args: False
    try:
        yield
    finally:
        hopper_wy.use_wy_grad = saved


def wy_grad_buffers(problem: dict) -> dict:
    """Fresh NaN-filled OUTPUTS for the problem, and a copy of its scratch (the Triton kernel adds to the partial dk
    in place)."""
    p = problem
    out = {name: buffers.nan_empty(*p[src].shape, dtype=p[src].dtype, device=p[src].device)
           for name, src in (("dq", "q"), ("dk", "k"), ("dv", "v"), ("dg", "g"), ("dbeta", "beta"))}
    out["scratch"] = {n: x.clone() if torch.is_tensor(x) else x for n, x in p["scratch"].items()}
    return out


def run_wy_grad(problem: dict, out: dict, gluon: bool) -> None:
    """function._wy_grad into wy_grad_buffers' out, the Gluon kernel where gluon (and use_wy_grad) says so."""
    p = problem
    with gluon_flag(gluon):
        function._wy_grad(p["q"], p["k"], p["v"], p["g"], p["beta"], p["tinv"], p["dv_new"], p["layout"], p["scale"],
                          False, p["l2norm"], p["norms"], out["scratch"], p["storage"],
                          (out["dq"], out["dk"], out["dv"], out["dg"], out["dbeta"]))


def wy_grad_outputs(problem: dict, gluon: bool) -> dict:
    """OUTPUTS as written into fresh NaN-filled buffers."""
    out = wy_grad_buffers(problem)
    run_wy_grad(problem, out, gluon)
    return {name: out[name] for name in OUTPUTS}
