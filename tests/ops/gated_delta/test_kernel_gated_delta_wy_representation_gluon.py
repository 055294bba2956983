"""The Gluon prep for Hopper (runtime/ops/gated_delta/gluon/wy_representation.py), GDN's: it compiles for sm_90a on any
machine (registers, spills, shared memory), the dispatch rules, a torch model of its algorithm (its work items, the
tiles TMA reads past a chunk's end, the inverse by forward substitution and merges of bf16 parts, the row factors
folded into Tinv's columns) against the Triton kernel, and on a Hopper GPU its outputs against the Triton kernel's on
the same inputs and the whole op with it against the fp64 reference.

Shape legend: T tokens, H heads, K key dim, V value dim, C chunk size, S the diagonal blocks' size.
"""
import json

import pytest
import torch

from runtime.ops.common import gluon_fallback
from runtime.ops.gated_delta import function
from runtime.ops.gated_delta.gluon import wy_representation as hopper_prep
from tests.ops.gated_delta.gated_delta_cases import check, make_inputs
from tests.ops.gated_delta.gated_delta_state_grad import differences
from tests.ops.gated_delta.test_kernel_gated_delta_state_grad_gluon import (compiled_resources, interpreted, needs_gluon, on_hopper,
                                                         split_bf16, tma_rows)

# the bytes ptxas spills (sm_90a, triton 3.6) without a backward's outputs: 12, reloads in the item loop; with them
# none (triton 3.9: 20 with them)
SPILL_BYTES = 24
COMPILE = """
import json, sys
from bench.kernel_resources import resources
from runtime.ops.gated_delta.gluon import state_grad as hopper, wy_representation as hopper_prep
gl = hopper.gl
l2norm, backward = json.loads(sys.argv[1]), json.loads(sys.argv[2])
layout = gl.NVMMASharedLayout.get_default_for([hopper.CHUNK, 128], gl.bfloat16)
tile = f"tensordesc<bf16[{hopper.CHUNK}, 128],{layout!r}>"
types = {n: tile for n in ("q_desc", "k_desc", "v_desc")}
types.update(chunk_start_ptr="*i32", chunk_end_ptr="*i32", u_ptr="*fp32", glast_ptr="*fp32", row_scales_ptr="*fp32",
             norms_ptr="*fp32", scale="fp32")
constexprs = dict(L2NORM=l2norm, S=hopper_prep.SUB_BLOCK, num_warps=4)
if not (backward and l2norm):
    constexprs["norms_ptr"] = None
if not backward:
    constexprs["tinv_ptr"] = None
aligned = tuple(n for n in ("w_ptr", "u_ptr", "p_ptr", "tinv_ptr", "zero") if n not in constexprs)
print(json.dumps(resources(hopper_prep.prep_kernel, types, constexprs, num_warps=4, divisible_by_16=aligned)))
"""


@needs_gluon
@pytest.mark.parametrize("backward", [True, False], ids=["backward", "forward-only"])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "no-l2norm"])
def test_gluon_prep_compiles_for_sm90a(l2norm, backward):
    used = compiled_resources(COMPILE, json.dumps(l2norm), json.dumps(backward))
    assert used["spill_bytes"] <= SPILL_BYTES, used
    # two programs an SM (hopper_prep.PROGRAMS_PER_SM): one alone would walk its items and then the other's
    assert 0 < used["shared_bytes"] <= hopper_prep.SHARED_BYTES_PER_PROGRAM, used
    assert used["registers"] <= 255, used


def test_shapes_the_gluon_prep_does_not_take_stay_on_triton():
    bf16 = torch.bfloat16
    assert hopper_prep.prep_fits(128, 128, 64, bf16, False)
    assert not hopper_prep.prep_fits(128, 128, 64, bf16, True)  # KDA: the per-channel path stays on Triton
    assert not hopper_prep.prep_fits(128, 128, 64, torch.float32, False)  # bf16 inputs only
    assert not hopper_prep.prep_fits(64, 128, 64, bf16, False)  # K = V = 128
    assert not hopper_prep.prep_fits(128, 256, 64, bf16, False)
    assert not hopper_prep.prep_fits(128, 128, 32, bf16, False)  # chunk 64
    q_THK = torch.zeros(64, 2, 128, dtype=bf16)
    assert not hopper_prep.use_prep(q_THK, q_THK, 64, False)  # CPU tensors


def prep_problem(lengths, H, l2norm, backward, device="cuda", seed=0):
    """The inputs of function._prep in bf16 (packed [T, H, *], sequences of `lengths`) and its other arguments."""
    x = make_inputs("gdn", T=sum(lengths), H=H, K=128, V=128, seed=seed)
    if not l2norm:
        # unit rows on average, as gated_delta_state_grad's problems: (I + L) stays well conditioned
        x["q"], x["k"] = x["q"] * 128 ** -0.5, x["k"] * 128 ** -0.5
    inputs = {n: x[n][0].to(device, torch.bfloat16) for n in ("q", "k", "v", "g", "beta")}
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    layout = function.ChunkLayout(cu_seqlens, function.CHUNK_SIZE)
    return dict(**inputs, layout=layout, scale=128 ** -0.5, per_channel=False, l2norm=l2norm, for_backward=backward,
                storage=function.Storage.of(torch.bfloat16))


def prep_outputs(problem, gluon: bool, monkeypatch) -> dict:
    """function._prep's tensors, through the Gluon kernel or (use_prep patched to False) the Triton kernel."""
    with monkeypatch.context() as patch:
        if not gluon:
            patch.setattr(hopper_prep, "use_prep", lambda *args: False)
        out = function._prep(**problem)
    return {name: x for name, x in out.items() if x is not None}


def model_item(p, chunk, head, C=64, S=hopper_prep.SUB_BLOCK):
    """(w, u, P, Tinv, gc, k_inv, q_inv) of one item as the kernel computes them, fp32: TMA's boxes (the next
    chunk's rows past this one's end, zeros past T), g and beta 0 past the end, exact Gram products of the bf16 rows,
    the diagonal blocks by forward substitution, the merges on operands of two bf16 parts, Tinv's columns scaled and
    rounded to bf16 as the A operand of w and u."""
    start, end = int(p["layout"].chunk_start[chunk]), int(p["layout"].chunk_end[chunk])
    count = end - start
    q, k, v = (tma_rows(p[n], start, head, 0, C, 128) for n in ("q", "k", "v"))
    valid = torch.arange(C) < count
    g = torch.where(valid, tma_rows(p["g"][:, :, None], start, head, 0, C, 1)[:, 0], 0.0)
    beta = torch.where(valid, tma_rows(p["beta"][:, :, None], start, head, 0, C, 1)[:, 0], 0.0)
    gc = g.cumsum(0)
    k_inv = 1 / torch.sqrt((k * k).sum(1) + 1e-6) if p["l2norm"] else torch.ones(C)
    q_inv = (1 / torch.sqrt((q * q).sum(1) + 1e-6) if p["l2norm"] else torch.ones(C)) * p["scale"]
    rows = torch.arange(C)
    decay = torch.where(rows[:, None] >= rows[None, :], gc[:, None] - gc[None, :], -torch.inf).exp()
    l_mat = (beta * k_inv)[:, None] * (k @ k.T) * k_inv[None, :] * decay
    l_mat = torch.where(rows[:, None] > rows[None, :], l_mat, 0.0)
    p_mat = q_inv[:, None] * (q @ k.T) * k_inv[None, :] * decay
    t = torch.zeros(C, C)
    for b in range(0, C, S):
        block = torch.eye(S)
        for j in range(S):
            block = block - l_mat[b:b + S, b + j:b + j + 1] * block[j:j + 1, :]
        t[b:b + S, b:b + S] = block
    size = S
    while size < C:
        pair = rows // (2 * size)
        odd = (rows // size) % 2 == 1
        below = (pair[:, None] == pair[None, :]) & odd[:, None] & ~odd[None, :]
        t = t - split_product(t, split_product(torch.where(below, l_mat, 0.0), t))
        size *= 2
    w = (t * (beta * k_inv * gc.exp())[None, :]).bfloat16().float() @ k
    u = (t * beta[None, :]).bfloat16().float() @ v
    return w, u, p_mat, t, gc, k_inv, q_inv


def split_product(a, b):
    """a @ b as the kernel's three MMAs on the bf16 parts: hi hi + hi lo + lo hi."""
    a_hi, b_hi = a.bfloat16().float(), b.bfloat16().float()
    return a_hi @ b_hi + a_hi @ (split_bf16(b) - b_hi) + (split_bf16(a) - a_hi) @ b_hi


def model_prep(p, C=64):
    """The model over every item, in function._prep's names and dtypes."""
    T, H, K = p["q"].shape
    out = {"w": torch.zeros(T, H, K), "u": torch.zeros(T, H, K), "p": torch.zeros(T, H, C),
           "tinv": torch.zeros(T, H, C), "row_scales": torch.zeros(T, H, 2), "norms": torch.zeros(T, H, 2),
           "glast": torch.zeros(p["layout"].num_chunks, H, 1)}
    for chunk in range(p["layout"].num_chunks):
        start, end = int(p["layout"].chunk_start[chunk]), int(p["layout"].chunk_end[chunk])
        n = end - start
        for head in range(H):
            w, u, p_mat, t, gc, k_inv, q_inv = model_item(p, chunk, head, C)
            last = gc[-1]
            out["w"][start:end, head], out["u"][start:end, head] = w[:n], u[:n]
            out["p"][start:end, head], out["tinv"][start:end, head] = p_mat[:n], t[:n]
            out["row_scales"][start:end, head] = torch.stack([k_inv * (last - gc).exp(), q_inv * gc.exp()], 1)[:n]
            out["norms"][start:end, head] = torch.stack([k_inv, q_inv], 1)[:n]
            out["glast"][chunk, head, 0] = last
    return out


# relative RMS of the model against the Triton kernel (observed on the CPU, varlen / no-l2norm: w 5.3e-3 / 4.5e-3, u
# 3.3e-3, P 3.5e-3 / 3.2e-3, Tinv 1.5e-4 / 1.6e-4, the row values 6e-8 or less): the Triton kernel rounds Tinv and the
# scaled key or value block to bf16 as w's and u's operands where the model rounds the scaled Tinv once; the model
# keeps P and Tinv in fp32 where the kernels store bf16; the row values agree to fp32 summation order
MODEL_REL_RMS = {"w": 1e-2, "u": 7e-3, "p": 7e-3, "tinv": 5e-4, "row_scales": 1e-6, "norms": 1e-6, "glast": 1e-6}


@pytest.mark.interpreter
@interpreted
@pytest.mark.parametrize("lengths,l2norm", [([65, 30, 100], True), ([100, 7], False)], ids=["varlen", "no-l2norm"])
def test_model_of_the_gluon_prep_matches_triton(lengths, l2norm, monkeypatch):
    problem = prep_problem(lengths, 2, l2norm, True, device="cpu")
    expected = prep_outputs(problem, False, monkeypatch)
    actual = model_prep(problem)
    for name, (max_abs, rel_rms, finite) in differences({n: actual[n] for n in expected},
                                                        {n: x.float() for n, x in expected.items()}).items():
        assert finite and rel_rms < MODEL_REL_RMS[name], (name, max_abs, rel_rms)


@pytest.mark.interpreter
@interpreted
def test_prep_dispatch_passes_the_buffers_and_falls_back(monkeypatch):
    """Where use_prep holds, function._prep_launches hands hopper_prep.prep the buffers by its contract; where that
    returns False (the kernel does not compile), the Triton kernel writes the outputs."""
    problem = prep_problem([64, 7], 2, True, True, device="cpu")
    expected = prep_outputs(problem, False, monkeypatch)
    seen = {}

    def prep(q, k, v, g, beta, chunk_start, chunk_end, w, u, p, glast, row_scales, tinv, norms, scale, l2norm):
        seen.update(q=q, w=w, u=u, p=p, tinv=tinv, norms=norms, l2norm=l2norm, scale=scale)
        return False

    monkeypatch.setattr(hopper_prep, "use_prep", lambda *args: True)
    monkeypatch.setattr(hopper_prep, "prep", prep)
    actual = function._prep(**problem)
    assert seen["q"] is problem["q"] and seen["l2norm"] and seen["scale"] == problem["scale"]
    for name in ("w", "u", "p", "tinv", "norms"):
        assert seen[name] is actual[name]
        assert torch.equal(actual[name], expected[name]), name


# the Gluon kernel against the Triton kernel on the GPU, relative RMS observed on the H200 (all four cases): w 3.1e-3
# to 3.2e-3 and u 1.7e-3 (the operands' roundings, as in the model), P 3.6e-6 or less, Tinv 2.2e-5 to 2.7e-5 (the
# Triton kernel's tf32 merges), the row values 4e-8 or less
GPU_REL_RMS = {"w": 6e-3, "u": 4e-3, "p": 1e-4, "tinv": 1e-4, "row_scales": 1e-6, "norms": 1e-6, "glast": 1e-6}


@on_hopper
@pytest.mark.parametrize("lengths,H,l2norm,backward", [([8192], 32, True, True), ([100, 37, 300], 4, True, True),
                                                       ([65, 191], 2, False, True), ([100, 37, 300], 4, True, False)],
                         ids=["T8192-H32", "varlen-odd", "varlen-no-l2norm", "forward-only"])
def test_gluon_prep_matches_triton(lengths, H, l2norm, backward, monkeypatch):
    problem = prep_problem(lengths, H, l2norm, backward)
    # else the Triton kernel would run twice
    assert hopper_prep.use_prep(problem["q"], problem["v"], 64, False)
    expected = prep_outputs(problem, False, monkeypatch)
    actual = prep_outputs(problem, True, monkeypatch)
    # it ran: a launcher that fell back to Triton would leave its name here
    assert "GDN prep" not in gluon_fallback.FAILED
    assert actual.keys() == expected.keys()
    found = differences({n: x.float().cpu() for n, x in actual.items()},
                        {n: x.float().cpu() for n, x in expected.items()})
    print(json.dumps({n: [float(d[0]), float(d[1])] for n, d in found.items()}))
    for name, (max_abs, rel_rms, finite) in found.items():
        assert finite and rel_rms < GPU_REL_RMS[name], (name, max_abs, rel_rms)


@on_hopper
def test_op_with_gluon_prep_matches_reference():
    x = make_inputs("gdn", T=200, H=2, K=128, V=128, num_states=2, seed=3)
    check("gdn", {n: t.cuda() for n, t in x.items()}, dtype=torch.bfloat16,
          cu_seqlens=torch.tensor([0, 77, 200], device="cuda"))
    assert "GDN prep" not in gluon_fallback.FAILED
