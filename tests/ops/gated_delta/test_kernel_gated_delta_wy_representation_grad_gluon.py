"""The Gluon wy_grad for Hopper (runtime/ops/gated_delta/gluon/wy_representation_grad.py), GDN's: it compiles for sm_90a on any
machine (registers, spills, shared memory), the dispatch rules, a torch model of its algorithm (its work items, the
tiles TMA reads past a chunk's end, its bf16 operands, dTinv's column factors applied after the products, the
partial dk rounded in place) against the Triton kernel, and on a Hopper GPU its outputs against the Triton kernel's
on the same inputs and the whole op with it against the fp64 reference.

Shape legend: T tokens, H heads, K key dim, V value dim, C chunk size, NC chunks, NK state_grad's key blocks.
"""
import json

import pytest
import torch

from runtime.ops.common import gluon_fallback
from runtime.ops.gated_delta.gluon import wy_representation_grad as hopper_wy
from runtime.tolerances import assert_close
from tests.ops.gated_delta.gated_delta_cases import check, make_inputs, ops
from tests.ops.gated_delta.gated_delta_state_grad import differences
from tests.ops.gated_delta.gated_delta_wy_grad import OUTPUTS, run_wy_grad, wy_grad_buffers, wy_grad_outputs, wy_grad_problem
from tests.ops.gated_delta.test_kernel_gated_delta_state_grad_gluon import (compiled_resources, interpreted, needs_gluon, on_hopper,
                                                         tma_rows)

# the bytes ptxas spills (sm_90a) with and without the l2norm: triton 3.6 36 and 172, 3.9 4 and 8 (with the l2norm, the
# benchmark's case, a few reloads an item in the loop; hopper_wy.py's module docstring)
SPILL_BYTES = {True: 40, False: 176}
# Compiles the kernel for sm_90a and prints its registers, spills and shared memory, in a process of its own (see
# test_kernel_gated_delta_hopper.py's COMPILE: no TRITON_INTERPRET there).
COMPILE = """
import json, sys
from bench.kernel_resources import resources
from runtime.ops.gated_delta.gluon import state_grad as hopper, wy_representation_grad as hopper_wy
gl = hopper.gl
l2norm = json.loads(sys.argv[1])
layout = gl.NVMMASharedLayout.get_default_for([hopper.CHUNK, 128], gl.bfloat16)
tile = f"tensordesc<bf16[{hopper.CHUNK}, 128],{layout!r}>"
types = {n: tile for n in ("dvn_desc", "v_desc", "k_desc", "w_desc", "q_desc", "pdq_desc", "pdk_desc")}
square = gl.NVMMASharedLayout.get_default_for([hopper.CHUNK, hopper.CHUNK], gl.bfloat16)
types["tinv_desc"] = f"tensordesc<bf16[{hopper.CHUNK}, {hopper.CHUNK}],{square!r}>"
types.update(norms_ptr="*fp32", chunk_start_ptr="*i32", chunk_end_ptr="*i32", dgc_ptr="*fp32",
             dgl_ptr="*fp32", scale="fp32")
constexprs = dict(L2NORM=l2norm, NK=4, num_warps=4)
if not l2norm:
    constexprs["norms_ptr"] = None
aligned = ("dv_ptr", "dq_ptr", "dk_ptr", "zero")
print(json.dumps(resources(hopper_wy.wy_grad_kernel, types, constexprs, num_warps=4, divisible_by_16=aligned)))
"""


@needs_gluon
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "no-l2norm"])
def test_gluon_wy_grad_compiles_for_sm90a(l2norm):
    used = compiled_resources(COMPILE, json.dumps(l2norm))
    assert used["spill_bytes"] <= SPILL_BYTES[l2norm], used
    # two programs an SM (hopper_wy.PROGRAMS_PER_SM): one alone would walk its items and then the other's
    assert 0 < used["shared_bytes"] <= hopper_wy.SHARED_BYTES_PER_PROGRAM, used
    assert used["registers"] <= 255, used


def test_shapes_the_gluon_wy_grad_does_not_take_stay_on_triton():
    bf16 = torch.bfloat16
    assert hopper_wy.wy_grad_fits(128, 128, 64, bf16, False)
    assert not hopper_wy.wy_grad_fits(128, 128, 64, bf16, True)  # KDA: the per-channel path stays on Triton
    assert not hopper_wy.wy_grad_fits(128, 128, 64, torch.float32, False)  # bf16 storage only
    assert not hopper_wy.wy_grad_fits(64, 128, 64, bf16, False)  # K = V = 128
    assert not hopper_wy.wy_grad_fits(128, 256, 64, bf16, False)
    assert not hopper_wy.wy_grad_fits(128, 128, 32, bf16, False)  # chunk 64
    q_THK, v_THV = torch.zeros(64, 2, 128, dtype=bf16), torch.zeros(64, 2, 128, dtype=bf16)
    assert not hopper_wy.use_wy_grad(q_THK, v_THV, v_THV, 64, False)  # CPU tensors


@pytest.mark.interpreter
@interpreted
def test_wy_grad_dispatch_passes_the_buffers_and_falls_back(monkeypatch):
    """Where use_wy_grad holds, function._wy_grad hands hopper_wy.wy_grad the buffers by its contract; where that
    returns False (the kernel does not compile), the Triton kernel writes the outputs."""
    problem = wy_grad_problem([64, 7], 2, True, device="cpu")
    expected = wy_grad_outputs(problem, gluon=False)
    seen = {}

    def wy_grad(q, k, v, g, beta, tinv, dv_new, dw, part_dq, part_dk, dgc, dgl, norms, chunk_start, chunk_end, dv, dq,
                dk, dbeta, dg, scale, l2norm):
        seen.update(tinv=tinv, dw=dw, part_dq=part_dq, part_dk=part_dk, dgc=dgc, dgl=dgl, norms=norms, dv=dv, dq=dq,
                    dk=dk, dbeta=dbeta, dg=dg, scale=scale, l2norm=l2norm)
        return False

    monkeypatch.setattr(hopper_wy, "use_wy_grad", lambda *args: True)
    monkeypatch.setattr(hopper_wy, "wy_grad", wy_grad)
    out = wy_grad_buffers(problem)
    run_wy_grad(problem, out, gluon=True)
    scratch = out["scratch"]
    for name in OUTPUTS:
        assert seen[name] is out[name], name
    for name, key in (("dw", "dw"), ("part_dq", "dq"), ("part_dk", "dk"), ("dgc", "dgc"), ("dgl", "dgl")):
        assert seen[name] is scratch[key], name
    assert seen["tinv"] is problem["tinv"] and seen["norms"] is problem["norms"] and seen["l2norm"] is True
    assert seen["scale"] == problem["scale"]
    for name in OUTPUTS:
        assert torch.equal(out[name], expected[name]), name


def bf16(x):
    return x.to(torch.bfloat16).float()


def finish_rows(x, part, inv, dy_scale, l2norm):
    """backward.finish_rows on [C, K] fp32 tiles: part dy_scale through the l2norm of the rows x inv."""
    dx = part * dy_scale
    if not l2norm:
        return dx
    y = x * inv[:, None]
    return inv[:, None] * (dx - y * (y * dx).sum(1, keepdim=True))


def item_inputs(p, chunk, head, C=64):
    """The item's tiles as its stage holds them (TMA: rows past the chunk's end from the next chunk, zeros past T)
    and its row inputs as the kernel's masked loads give them, fp32: (start, count, tiles dict, Tinv [C, C], beta,
    gc, q's and k's row scales [C], the rows' validity and token indices [C], clamped to T)."""
    s = p["scratch"]
    start = int(p["layout"].chunk_start[chunk])
    count = int(p["layout"].chunk_end[chunk]) - start
    sources = dict(dvn=p["dv_new"], v=p["v"], k=p["k"], dw=s["dw"], q=p["q"], pdq=s["dq"], pdk=s["dk"])
    tiles = {n: tma_rows(x, start, head, 0, C, x.shape[-1]) for n, x in sources.items()}
    rows = torch.arange(C)
    valid = rows < count
    tok = (start + rows).clamp_max(p["q"].shape[0] - 1)
    masked = lambda x: torch.where(valid, x[tok, head].float(), 0.0)  # noqa: E731
    tinv = torch.where(valid[:, None], p["tinv"][tok, head].float(), 0.0)
    if p["l2norm"]:
        k_scale, q_scale = (masked(p["norms"][..., slot]) for slot in (0, 1))
    else:
        k_scale, q_scale = torch.ones(C), torch.full((C,), p["scale"])
    return start, count, tiles, tinv, masked(p["beta"]), masked(p["g"]).cumsum(0), q_scale, k_scale, valid, tok


def model_item(p, chunk, head, C=64):
    """One work item (chunk, head) of hopper_wy.wy_grad_kernel in torch, step by step as the kernel takes it: (dq,
    dk, dv [C, 128], dbeta, dg [C]) of its chunk's C rows (rows past the chunk's end included), fp32."""
    start, count, t, tinv, beta, gc, q_scale, k_inv, valid, tok = item_inputs(p, chunk, head, C)
    scale, l2norm = p["scale"], p["l2norm"]
    dq = finish_rows(t["q"], t["pdq"], q_scale / scale, scale, l2norm)
    tb, eg = bf16(tinv), gc.exp()
    dbv = tb.T @ t["dvn"]
    db = (dbv * t["v"]).sum(1)
    # the row factors scale dTinv's columns after the products (the Triton kernel rounds beta v and beta k e^gc)
    dtinv = (t["dvn"] @ t["v"].T) * beta[None, :] + (t["dw"] @ t["k"].T) * (beta * k_inv * eg)[None, :]
    dtinv = torch.where(valid[:, None], dtinv, 0.0)
    db += ((tb.T @ t["dw"]) * t["k"]).sum(1) * k_inv * eg
    rows = torch.arange(C)
    lower = rows[:, None] > rows[None, :]
    dl = bf16(tb.T @ bf16(dtinv)) @ tb.T
    dme = torch.where(lower, -dl * torch.where(lower, gc[:, None] - gc[None, :], 0.0).exp(), 0.0)
    da = bf16(dme * k_inv[None, :]) @ t["k"]
    dc = bf16(dme * (beta * k_inv)[:, None]).T @ t["k"]
    dkt = (beta * eg)[:, None] * (tb.T @ t["dw"])
    k = t["k"] * k_inv[:, None]
    db += (da * k).sum(1)
    dgc = torch.where(valid, (k * (beta[:, None] * da - dc + dkt)).sum(1), 0.0)
    part_dk = bf16(t["pdk"] + beta[:, None] * da + dc + dkt)
    dk = finish_rows(t["k"], part_dk, k_inv, 1.0, l2norm)
    s = p["scratch"]
    NK = s["dgl"].shape[-1]
    dgc = dgc + torch.where(valid, s["dgc"][tok, head, :NK].sum(-1), 0.0)
    dg = s["dgl"][chunk, head].sum() + dgc.sum() - dgc.cumsum(0) + dgc
    return dq, dk, beta[:, None] * dbv, db, dg


def model_wy_grad(p, C=64):
    """OUTPUTS of the model over every item, bf16 as the kernel stores them."""
    T, H, K = p["q"].shape
    out = {name: torch.zeros(T, H, K) for name in ("dq", "dk", "dv")}
    out["dbeta"], out["dg"] = torch.zeros(T, H), torch.zeros(T, H)
    for chunk in range(p["layout"].num_chunks):
        start, end = int(p["layout"].chunk_start[chunk]), int(p["layout"].chunk_end[chunk])
        for head in range(H):
            for name, x in zip(("dq", "dk", "dv", "dbeta", "dg"), model_item(p, chunk, head, C)):
                out[name][start:end, head] = x[:end - start]
    return {name: x.to(torch.bfloat16) for name, x in out.items()}


# relative RMS of the model against the Triton kernel (observed on the CPU, see the test's ids); the outputs are
# bf16 (the interpreter's fp32 -> bf16 truncates: ~4e-3), and dTinv's operands differ (beta v and beta k e^gc not
# rounded here)
MODEL_REL_RMS = {"dq": 1e-2, "dk": 1e-2, "dv": 1e-2, "dbeta": 1e-2, "dg": 1e-2}


def cpu_problem(problem):
    cpu = {n: x.cpu() if torch.is_tensor(x) else x for n, x in problem.items()}
    cpu["scratch"] = {n: x.cpu() if torch.is_tensor(x) else x for n, x in problem["scratch"].items()}
    return cpu


# two chunks in the first sequence of each (a later chunk reads dTinv's rows past a partial chunk from the next)
@pytest.mark.interpreter
@interpreted
@pytest.mark.parametrize("lengths,l2norm", [([65, 30, 100], True), ([100, 7], False)], ids=["varlen", "no-l2norm"])
def test_model_of_the_gluon_wy_grad_matches_triton(lengths, l2norm):
    problem = wy_grad_problem(lengths, 2, l2norm, device="cpu")
    expected = wy_grad_outputs(problem, gluon=False)
    actual = model_wy_grad(cpu_problem(problem))
    for name, (max_abs, rel_rms, finite) in differences(actual, {n: x.cpu() for n, x in expected.items()}).items():
        assert finite and rel_rms < MODEL_REL_RMS[name], (name, max_abs, rel_rms)


@on_hopper
@pytest.mark.parametrize("lengths,H,l2norm", [([8192], 32, True), ([100, 37, 300], 4, True), ([65, 191], 2, False)],
                         ids=["T8192-H32", "varlen-odd", "varlen-no-l2norm"])
def test_gluon_wy_grad_matches_triton(lengths, H, l2norm):
    problem = wy_grad_problem(lengths, H, l2norm)
    # else the Triton kernel would run twice
    assert hopper_wy.use_wy_grad(problem["q"], problem["v"], problem["dv_new"], 64, False)
    expected = wy_grad_outputs(problem, gluon=False)
    actual = wy_grad_outputs(problem, gluon=True)
    # it ran: a launcher that fell back to Triton would leave its name here
    assert "GDN wy_grad" not in gluon_fallback.FAILED
    op = ops()["gdn"][0]
    for name in OUTPUTS:
        assert_close(actual[name], expected[name], op, torch.bfloat16, "grad", name)


@on_hopper
def test_op_with_gluon_wy_grad_matches_reference():
    x = make_inputs("gdn", T=200, H=2, K=128, V=128, num_states=2, seed=3)
    check("gdn", {n: t.cuda() for n, t in x.items()}, dtype=torch.bfloat16,
          cu_seqlens=torch.tensor([0, 77, 200], device="cuda"))
    assert "GDN wy_grad" not in gluon_fallback.FAILED
