"""The Gluon state_grad for Hopper (runtime/ops/gated_delta/gluon/state_grad.py), GDN's and KDA's: it compiles for sm_90a
on any machine (Gluon has no CPU interpreter: the installed triton accepts it, registers, spills, shared memory), the
dispatch rules, torch models of its algorithm (its work items, the tiles TMA reads past a chunk's end, the folded
scales, dme's two bf16 parts, the slots; KDA's per-key decay and dP's columns by key half) against the Triton kernel,
and on a Hopper GPU its outputs against the Triton kernel's on the same inputs and the whole op with it against the
fp64 reference.

Shape legend: T tokens, H heads, K key dim, V value dim, C chunk size, KH keys an item, NC chunks.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from runtime.ops.common import gluon_fallback
from runtime.ops.gated_delta.gluon import state_grad as hopper
from runtime.ops.common.launch import interpreting
from runtime.tolerances import assert_close
from tests.ops.gated_delta.gated_delta_cases import check, make_inputs, ops
from tests.ops.gated_delta.gated_delta_state_grad import differences, state_grad_outputs, state_grad_problem

needs_gluon = pytest.mark.skipif(hopper.gluon is None, reason="this triton has no Gluon Hopper modules")
# the models are checked against the Triton kernel's fp32 products under the interpreter; compiled for a GPU it takes
# tf32 and bf16 products, ~1e-3 apart, and there the Gluon kernel itself is compared with it (the on_hopper tests)
interpreted = pytest.mark.skipif(not interpreting(), reason="the torch models are checked under TRITON_INTERPRET=1")
on_hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                               reason="the Gluon kernel runs on Hopper (sm_90) only")
REPO = Path(__file__).resolve().parents[3]
# under triton 3.6 ptxas keeps words of KDA's second warpgroup's arguments in local memory from the kernel's entry to
# that warpgroup's start: once a program, outside the item loop (3 or 4 words, a 16-byte frame; triton 3.9: none).
# GDN's programs are of one warpgroup: none
ENTRY_SPILL_BYTES = {"gdn": 0, "kda": 16}
# Compiles the kernel for sm_90a and prints its registers, spills and shared memory. In a process of its own: under
# TRITON_INTERPRET=1 (set for the tests where no GPU is) triton.language's jit functions, gl.sum among them, are
# interpreter objects that a compiled kernel cannot call.
COMPILE = """
import json, sys
from bench.kernel_resources import resources
from runtime.ops.gated_delta.gluon import state_grad as hopper
from runtime.ops.common.launch import interpreting
gl = hopper.gl
l2norm, kind = json.loads(sys.argv[1]), sys.argv[2]

def desc(rows, cols):
    layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)
    return f"tensordesc<bf16[{rows}, {cols}],{layout!r}>"

C, KH, V = hopper.CHUNK, hopper.KEYS_PER_ITEM, hopper.VALUE_DIM
types = {name: desc(C, V) for name in ("do_desc", "vnew_desc", "dvnew_desc", "h_desc", "dh_desc")}
types.update({name: desc(C, KH) for name in ("q_desc", "k_desc")})
types.update(g_ptr="*bf16", norms_ptr="*fp32", chunk_start_ptr="*i32", chunk_end_ptr="*i32", dgc_ptr="*fp32",
             dgl_ptr="*fp32", scale="fp32")
constexprs = dict(L2NORM=l2norm, num_warps=4)
# the launch specializes the contiguous rows' pointers and `zero` (0) as multiples of 16
aligned = ("dq_ptr", "dk_ptr", "dw_ptr", "zero")
if kind == "kda":
    kernel = hopper.channel_state_grad_kernel
    types.update(dpdiag_ptr="*fp32", dpfull_ptr="*fp32", gcs_ptr="*fp32")
    constexprs.update(S=16, WORKER_REGS=hopper.WORKER_REGS)
    aligned += ("g_ptr", "dgc_ptr", "gcs_ptr", "dpfull_ptr", "dpdiag_ptr")
else:
    kernel = hopper.state_grad_kernel
    constexprs["NK"] = hopper.KEY_DIM // (KH // 2)
if not l2norm:
    constexprs["norms_ptr"] = None
print(json.dumps(resources(kernel, types, constexprs, num_warps=4, divisible_by_16=aligned)))
"""


def compiled_resources(script: str, *args: str) -> dict:
    """The JSON a compile script prints last (bench.kernel_resources' registers, spills, shared bytes), run in a
    process of its own without TRITON_INTERPRET; skips the test where the installed triton's Gluon API differs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO)]))
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    if done.returncode and "CompilationError" in done.stderr:
        pytest.skip(f"the Gluon kernel does not compile with triton {triton.__version__} (another Gluon API): "
                    + done.stderr.strip().splitlines()[-1][:200])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_gluon
@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "no-l2norm"])
def test_gluon_state_grad_compiles_for_sm90a(l2norm, kind):
    used = compiled_resources(COMPILE, json.dumps(l2norm), kind)
    # the stack frame holds those words
    assert used["spill_bytes"] <= ENTRY_SPILL_BYTES[kind] and used["stack_bytes"] <= ENTRY_SPILL_BYTES[kind], used
    # GDN's kernel runs hopper.PROGRAMS_PER_SM programs an SM (228 KB an SM, 1 KB of it the driver's a program)
    limit = hopper.SHARED_BYTES if kind == "kda" else 228 * 1024 // hopper.PROGRAMS_PER_SM - 1024
    assert 0 < used["shared_bytes"] <= limit, used
    assert used["registers"] <= 255, used


def test_shapes_the_gluon_tiles_do_not_take_stay_on_triton():
    bf16 = torch.bfloat16
    assert hopper.state_grad_fits(128, 128, 64, 32, bf16, False)
    assert hopper.state_grad_fits(128, 128, 64, 32, bf16, True)  # KDA's per-channel decay
    assert hopper.state_grad_fits(128, 128, 64, 64, bf16, True)  # KDA's dgc and dgl have no key-block slots
    assert not hopper.state_grad_fits(128, 128, 64, 32, torch.float32, False)  # bf16 storage only
    assert not hopper.state_grad_fits(128, 128, 64, 32, torch.float32, True)
    assert not hopper.state_grad_fits(64, 128, 64, 32, bf16, True)
    assert not hopper.state_grad_fits(128, 128, 32, 32, bf16, True)
    assert not hopper.state_grad_fits(64, 128, 64, 32, bf16, False)  # K = V = 128
    assert not hopper.state_grad_fits(128, 256, 64, 32, bf16, False)
    assert not hopper.state_grad_fits(128, 128, 32, 32, bf16, False)  # chunk 64
    assert not hopper.state_grad_fits(128, 128, 64, 64, bf16, False)  # the Triton kernel's slots: key blocks of 32
    q_THK, h = torch.zeros(64, 2, 128, dtype=bf16), torch.zeros(1, 2, 128, 128, dtype=bf16)
    for per_channel in (False, True):
        assert not hopper.use_state_grad(q_THK, h, 64, 32, per_channel)  # CPU tensors


def tma_rows(x_THD, start, head, col0, rows, cols):
    """A TMA box of rows start.. start + rows - 1 of a packed [T, H, D] tensor, one head, in fp32: zeros past T."""
    box = torch.zeros(rows, cols)
    n = max(0, min(rows, x_THD.shape[0] - start))
    box[:n] = x_THD[start:start + n, head, col0:col0 + cols].float()
    return box


def split_bf16(x):
    hi = x.to(torch.bfloat16).float()
    return hi + (x - hi).to(torch.bfloat16).float()


def item_tiles(p, chunk, head, half, C=64, KH=64):
    """An item's tiles as its stage holds them (rows past the chunk's end as TMA reads them), fp32: (start, count,
    do, v_new, dv_new [C, V], h, dh [KH, V], q, k [C, KH], the row scales of q and k [C], the rows' validity and
    token indices [C], clamped to T)."""
    start = int(p["layout"].chunk_start[chunk])
    count = int(p["layout"].chunk_end[chunk]) - start
    do, vn, dvn = (tma_rows(p[n], start, head, 0, C, p[n].shape[-1]) for n in ("do", "v_new", "dv_new"))
    h, dh = (p[n][chunk, head, half * KH:(half + 1) * KH].float() for n in ("h", "dh"))
    q, k = (tma_rows(p[n], start, head, half * KH, C, KH) for n in ("q", "k"))
    rows = torch.arange(C)
    valid = rows < count
    tok = (start + rows).clamp_max(p["q"].shape[0] - 1)
    if p["l2norm"]:
        k_scale, q_scale = (torch.where(valid, p["norms"][tok, head, slot], 0.0) for slot in (0, 1))
    else:
        k_scale, q_scale = torch.ones(C), torch.full((C,), p["scale"])
    return start, count, do, vn, dvn, h, dh, q, k, q_scale, k_scale, valid, tok


def model_item(p, chunk, head, half, C=64, KH=64):
    """One work item of hopper.state_grad_kernel in torch, step by step as the kernel takes it: (dq, dk, dw, dgc,
    dgl) of its chunk's C rows (rows past the chunk's end included), fp32; dgc and dgl summed by key block."""
    start, count, do, vn, dvn, h, dh, q, k, q_scale, k_scale, valid, tok = item_tiles(p, chunk, head, half, C, KH)
    rows = torch.arange(C)
    gc = torch.where(valid, p["g"][tok, head].float(), 0.0).cumsum(0)
    last = gc[-1]
    dq = (do @ h.T) * gc.exp()[:, None]
    dk = torch.where(valid[:, None], (vn @ dh.T) * (last - gc).exp()[:, None], 0.0)
    dgl = (k * k_scale[:, None] * dk).sum(0) + last.exp() * (h * dh).sum(1)
    causal = (rows[:, None] >= rows[None, :]) & valid[:, None]
    dme = torch.where(causal, (do @ vn.T) * torch.where(causal, gc[:, None] - gc[None, :], 0.0).exp(), 0.0)
    dq = dq + split_bf16(dme * k_scale[None, :]) @ k
    dk = dk + split_bf16(dme * q_scale[:, None]).T @ q
    dgc = q * q_scale[:, None] * dq - k * k_scale[:, None] * dk
    blocks = lambda x: x.unflatten(-1, (2, KH // 2)).sum(-1)  # noqa: E731
    return dq, dk, -(dvn @ h.T), blocks(dgc), blocks(dgl)


def model_state_grad(p, KH=64):
    """OUTPUTS of the model over every item, in the kernel's storage dtypes."""
    NC, H, K, _ = p["h"].shape
    T = p["q"].shape[0]
    out = {name: torch.zeros(T, H, K) for name in ("dq", "dk", "dw")}
    out["dgc"], out["dgl"] = torch.zeros(T, H, K // (KH // 2)), torch.zeros(NC, H, K // (KH // 2))
    for chunk in range(NC):
        start, end = int(p["layout"].chunk_start[chunk]), int(p["layout"].chunk_end[chunk])
        for head in range(H):
            for half in range(K // KH):
                dq, dk, dw, dgc, dgl = model_item(p, chunk, head, half)
                for name, x in (("dq", dq), ("dk", dk), ("dw", dw)):
                    out[name][start:end, head, half * KH:(half + 1) * KH] = x[:end - start]
                out["dgc"][start:end, head, 2 * half:2 * half + 2] = dgc[:end - start]
                out["dgl"][chunk, head, 2 * half:2 * half + 2] = dgl
    return {name: x.to(torch.bfloat16) if name in ("dq", "dk", "dw") else x for name, x in out.items()}


# relative RMS of the model against the Triton kernel: dq, dk and dw differ by their bf16 rounding (the interpreter's
# fp32 -> bf16 truncates: ~4e-3 there), dgc and dgl (fp32) by the order of sums and dme's parts (observed 1.7e-6 and
# 8.7e-8 on the CPU; with one bf16 part 1.2e-3)
MODEL_REL_RMS = {"dq": 1e-2, "dk": 1e-2, "dw": 1e-2, "dgc": 1e-4, "dgl": 1e-4}


def model_channel_item(p, chunk, head, half, C=64, KH=64):
    """One work item of hopper.channel_state_grad_kernel (KDA) in torch as the kernel takes it: (dq, dk, dw, dgc
    [C, KH], dgl [KH], gc [C, KH], dP's columns of the item's half [C, C / 2]) of its chunk's C rows (rows past the
    chunk's end included), fp32."""
    start, count, do, vn, dvn, h, dh, q, k, q_scale, k_scale, valid, tok = item_tiles(p, chunk, head, half, C, KH)
    rows = torch.arange(C)
    g = p["g"][tok, head, half * KH:(half + 1) * KH].float()
    gc = torch.where(valid[:, None], g, 0.0).cumsum(0)
    last = gc[-1]
    dq = (do @ h.T) * gc.exp()
    dk = torch.where(valid[:, None], (vn @ dh.T) * (last - gc).exp(), 0.0)
    dgl = (k * k_scale[:, None] * dk).sum(0) + last.exp() * (h * dh).sum(1)
    cols = half * (C // 2) + torch.arange(C // 2)
    dp = torch.where(rows[:, None] >= cols[None, :], do @ vn[cols].T, 0.0)
    dgc = q * q_scale[:, None] * dq - k * k_scale[:, None] * dk
    return dq, dk, -(dvn @ h.T), dgc, dgl, gc, dp


def model_channel_state_grad(p, C=64, S=16, KH=64):
    """OUTPUTS["kda"] of the model over every item, in the kernel's storage dtypes."""
    NC, H, K, _ = p["h"].shape
    T = p["q"].shape[0]
    out = {name: torch.zeros(T, H, K) for name in ("dq", "dk", "dw", "dgc", "gcs")}
    out["dgl"], out["dpfull"], out["dpdiag"] = torch.zeros(NC, H, K), torch.zeros(T, H, C), torch.zeros(T, H, S)
    for chunk in range(NC):
        start, end = int(p["layout"].chunk_start[chunk]), int(p["layout"].chunk_end[chunk])
        n = end - start
        for head in range(H):
            for half in range(K // KH):
                dq, dk, dw, dgc, dgl, gc, dp = model_channel_item(p, chunk, head, half, C, KH)
                keys = slice(half * KH, (half + 1) * KH)
                for name, x in (("dq", dq), ("dk", dk), ("dw", dw), ("dgc", dgc), ("gcs", gc)):
                    out[name][start:end, head, keys] = x[:n]
                out["dgl"][chunk, head, keys] = dgl
                col0 = half * (C // 2)
                out["dpfull"][start:end, head, col0:col0 + C // 2] = dp[:n]
                # the S x S diagonal blocks within this half's columns
                for block in range(col0 // S, (col0 + C // 2) // S):
                    rows = slice(block * S, min((block + 1) * S, n))
                    out["dpdiag"][start + block * S:start + min((block + 1) * S, n), head] = \
                        dp[rows, block * S - col0:(block + 1) * S - col0]
    return {name: x.to(torch.bfloat16) if name in ("dq", "dk", "dw") else x for name, x in out.items()}


# relative RMS of KDA's model against the Triton kernel: dq, dk and dw by their bf16 rounding as GDN's (observed
# 4.3e-3), the fp32 outputs by the order of sums (observed on the CPU: dgc 1.0e-7, dgl 1.2e-7, dpdiag and dpfull
# 8.1e-8, gcs 0)
MODEL_CHANNEL_REL_RMS = {"dq": 1e-2, "dk": 1e-2, "dw": 1e-2, "dgc": 1e-6, "dgl": 1e-6, "dpdiag": 1e-6, "dpfull": 1e-6,
                         "gcs": 1e-6}


MODELS = {"gdn": (model_state_grad, MODEL_REL_RMS), "kda": (model_channel_state_grad, MODEL_CHANNEL_REL_RMS)}


# KDA's cases have two chunks in the first sequence of each: dh (and so dkbar, dlam) is 0 in a sequence's last chunk
@pytest.mark.interpreter
@interpreted
@pytest.mark.parametrize("kind,lengths,l2norm", [("gdn", [65, 30, 100], True), ("gdn", [64, 7], False),
                                                 ("kda", [65, 30, 100], True), ("kda", [100, 7], False)],
                         ids=["gdn-varlen", "gdn-no-l2norm", "kda-varlen", "kda-no-l2norm"])
def test_model_of_the_gluon_algorithm_matches_triton(kind, lengths, l2norm):
    problem = state_grad_problem(lengths, 2, l2norm, device="cpu", kind=kind)
    model, bounds = MODELS[kind]
    for name, (max_abs, rel_rms, finite) in differences(model(problem), state_grad_outputs(problem, False)).items():
        assert finite and rel_rms < bounds[name], (name, max_abs, rel_rms)


# the benchmark's shape (one sequence of 8192 tokens, 32 heads) and three odd-length sequences (partial chunks)
@on_hopper
@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("lengths,H,l2norm", [([8192], 32, True), ([100, 37, 300], 4, True), ([65, 191], 2, False)],
                         ids=["T8192-H32", "varlen-odd", "varlen-no-l2norm"])
def test_gluon_state_grad_matches_triton(lengths, H, l2norm, kind):
    problem = state_grad_problem(lengths, H, l2norm, kind=kind)
    # else the Triton kernel would run twice
    assert hopper.use_state_grad(problem["q"], problem["h"], 64, 32, problem["per_channel"])
    expected = state_grad_outputs(problem, gluon=False)
    actual = state_grad_outputs(problem, gluon=True)
    # it ran: a launcher that fell back to Triton would leave its name here
    assert f"{kind.upper()} state_grad" not in gluon_fallback.FAILED
    op = ops()[kind][0]
    for name, e in expected.items():
        assert_close(actual[name], e, op, torch.bfloat16, "grad", name)


@on_hopper
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_op_with_gluon_state_grad_matches_reference(kind):
    x = make_inputs(kind, T=200, H=2, K=128, V=128, num_states=2, seed=3)
    check(kind, {n: t.cuda() for n, t in x.items()}, dtype=torch.bfloat16,
          cu_seqlens=torch.tensor([0, 77, 200], device="cuda"))
    assert f"{kind.upper()} state_grad" not in gluon_fallback.FAILED
