"""The state_grad step alone, GDN's or KDA's: its inputs at a given shape (from the forward and backward scans of
random bf16 inputs) and its outputs from the Triton kernel or the Gluon one (runtime/ops/gated_delta/gluon/state_grad.py)
in NaN-filled scratch, for test_kernel_gated_delta_hopper.py and device probes (a helper module, not a test file).

Shape legend: T packed tokens, H heads, K key dim, V value dim, N sequences, NC chunks, NK state_grad's key blocks,
C chunk size, S sub-chunk size.
"""
from __future__ import annotations

import contextlib

import torch

from runtime.ops.common import buffers
from runtime.ops.gated_delta import function
from runtime.ops.gated_delta.gluon import state_grad as hopper
from tests.ops.gated_delta.gated_delta_cases import make_inputs

# what state_grad writes by kind: dq, dk, dw [T, H, K] bf16; GDN dgc [T, H, NK + 1] (its NK slots) and dgl
# [NC, H, NK] fp32; KDA dgc, gcs [T, H, K], dgl [NC, H, K], dpfull [T, H, C], dpdiag [T, H, S] fp32
OUTPUTS = {"gdn": ("dq", "dk", "dw", "dgc", "dgl"), "kda": ("dq", "dk", "dw", "dgc", "dgl", "dpdiag", "dpfull", "gcs")}


def state_grad_problem(lengths: list[int], H: int, l2norm: bool = True, K: int = 128, V: int = 128, seed: int = 0,
                       device: str = "cuda", kind: str = "gdn") -> dict:
    """state_grad's inputs for N packed sequences of the given lengths: the arguments of function._state_grad; kind
    "gdn" (g [T, H]) or "kda" (per-channel g [T, H, K])."""
    per_channel = kind == "kda"
    x = make_inputs(kind, T=sum(lengths), H=H, K=K, V=V, num_states=len(lengths), seed=seed)
    if not l2norm:
        # unit rows on average: the delta rule's state stays bounded (beta |k|^2 < 2) without the l2norm
        x["q"], x["k"] = x["q"] * K**-0.5, x["k"] * K**-0.5
    q, k, v, g, beta = (x[n][0].to(device, torch.bfloat16).contiguous() for n in ("q", "k", "v", "g", "beta"))
    h0 = x["h0"].to(device).contiguous()
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    layout = function.ChunkLayout(cu_seqlens, function.CHUNK_SIZE)
    storage = function.Storage.of(torch.bfloat16)
    scale = K**-0.5
    prep = function._prep(q, k, v, g, beta, layout, scale, per_channel, l2norm, True, storage)
    h, v_new, _, _ = function._scan(prep, q, k, h0, layout, per_channel, torch.bfloat16, storage, True)
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device, torch.bfloat16)
    dh, dv_new, _ = function._scan_bwd(prep, q, k, do, None, layout, per_channel, False, storage)
    # v, beta and Tinv for wy_grad, the next step (gated_delta_wy_grad.py)
    return dict(q=q, k=k, g=g, h=h, dh=dh, v_new=v_new, dv_new=dv_new, do=do, layout=layout, scale=scale,
                per_channel=per_channel, l2norm=l2norm, norms=prep["norms"], storage=storage, kind=kind, v=v,
                beta=beta, tinv=prep["tinv"])


@contextlib.contextmanager
def gluon_flag(on: bool):
    """The Gluon kernel where hopper.use_state_grad allows it (on), or the Triton kernel everywhere (off), for the
    block."""
    saved = hopper.use_state_grad
    if not on:
        hopper.use_state_grad = lambda *args: False
    try:
        yield
    finally:
        hopper.use_state_grad = saved


def state_grad_scratch(problem: dict, nan: bool = True) -> dict:
    """function._grad_scratch for the problem, NaN-filled unless nan is False."""
    key_blocks = problem["q"].shape[-1] // min(function.STATE_GRAD_KEY_BLOCK, problem["q"].shape[-1])
    saved = buffers.empty
    buffers.empty = buffers.nan_empty if nan else saved
    try:
        return function._grad_scratch(problem["q"], problem["layout"], problem["per_channel"], key_blocks,
                                      problem["storage"])
    finally:
        buffers.empty = saved


def run_state_grad(problem: dict, scratch: dict, gluon: bool) -> None:
    """function._state_grad into scratch, the Gluon kernel where gluon (and use_state_grad) says so."""
    p = problem
    with gluon_flag(gluon):
        function._state_grad(p["q"], p["k"], p["g"], p["h"], p["dh"], p["v_new"], p["dv_new"], p["do"], p["layout"],
                             p["scale"], p["per_channel"], p["l2norm"], p["norms"], scratch, p["storage"])


def state_grad_outputs(problem: dict, gluon: bool) -> dict:
    """The problem kind's OUTPUTS as written into fresh NaN-filled scratch (GDN's dgc without its last slot, which
    state_grad leaves)."""
    scratch = state_grad_scratch(problem)
    run_state_grad(problem, scratch, gluon)
    out = {name: scratch[name] for name in OUTPUTS[problem["kind"]]}
    if not problem["per_channel"]:
        out["dgc"] = out["dgc"][..., :-1]
    return out


def differences(actual: dict, expected: dict) -> dict:
    """name -> (max-abs difference, relative RMS difference, whether actual is all finite), in fp32."""
    report = {}
    for name, e in expected.items():
        a, e = actual[name].float(), e.float()
        rel_rms = ((a - e).square().sum() / e.square().sum().clamp_min(1e-30)).sqrt().item()
        report[name] = ((a - e).abs().max().item(), rel_rms, bool(torch.isfinite(a).all()))
    return report
