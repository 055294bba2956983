"""The Gluon DSA kernels for Hopper (runtime/ops/dsa/gluon/sparse_attention.py): their tiles compile for sm_90a on any
machine (Gluon has no CPU interpreter, so this is what CI can check of them: the installed triton accepts them,
nothing spills, shared memory fits), the dispatch rules, and on a Hopper GPU their results against the fp64
reference and against the Triton kernels they replace.

Shape legend: B batch, T tokens, H heads, K = V + R key width, V value width, R rope width, S selected keys.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reference_ops import dsa as ref
from runtime.ops.dsa import kernel as kernels
from runtime.ops.common import gluon_fallback
from runtime.ops.dsa.gluon import sparse_attention as hopper
from runtime.tolerances import assert_close
from tests.ops.dsa.dsa_problems import random_sparse_problem, with_dropped_slots

needs_gluon = pytest.mark.skipif(hopper.gluon is None, reason="this triton has no Gluon Hopper modules")
on_hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                               reason="the Gluon kernels run on Hopper (sm_90) only")

# (H, V, R): the benchmark's MLA shape, a narrower one, and a rope width the forward takes but the dkv pass not
SHAPES = [(128, 512, 64), (64, 256, 64), (64, 256, 32)]
REPO = Path(__file__).resolve().parents[3]
# Compiles both kernels for sm_90a and prints their registers, spills and shared memory. In a process of its own:
# under TRITON_INTERPRET=1 (set for these tests where no GPU is) triton.language's own jit functions, gl.max among
# them, are interpreter objects that a compiled kernel cannot call.
COMPILE = """
import json, sys
from bench.kernel_resources import resources
from runtime.ops.dsa.gluon import sparse_attention as hopper
H, V, R = json.loads(sys.argv[1])
pointers = ("q_ptr", "kv_ptr", "idx_ptr", "o_ptr", "lse_ptr", "do_ptr", "p_ptr", "ds_ptr", "dkv_ptr")
types = {"idx_ptr": "*i32", "lse_ptr": "*fp32", "dkv_ptr": "*fp32", "scale_log2": "fp32"}

def used(kernel, constexprs, num_warps):
    # the launch specializes contiguous bf16 rows' pointers, S (a multiple of 64 here) and the forward's zero as
    # multiples of 16
    divisible = tuple(n for n in kernel.arg_names if n in pointers or n in ("S", "zero"))
    return resources(kernel, types, constexprs, num_warps=num_warps, divisible_by_16=divisible)

report = {}
if hopper.forward_fits(H, V, R, hopper.torch.bfloat16):
    report["forward"] = used(hopper._fwd_kernel, dict(V=V, R=R, BH=hopper.FWD_HEADS, BS=hopper.FWD_KEYS,
                                                      WG1_REGS=hopper.FWD_WG1_REGS,
                                                      PRODUCER_WARPS=hopper.FWD_PRODUCER_WARPS,
                                                      PRODUCER_REGS=hopper.forward_producer_regs(V), num_warps=4), 4)
if hopper.dkv_fits(H, V, R, 2048, hopper.torch.bfloat16):
    report["dkv"] = used(hopper._bwd_dkv_kernel, dict(H=H, V=V, R=R, BS=hopper.DKV_SLOTS, BC=hopper.DKV_COLUMNS,
                                                      num_warps=hopper.DKV_WARPS), hopper.DKV_WARPS)
print(json.dumps(report))
"""


@needs_gluon
@pytest.mark.parametrize("H,V,R", SHAPES)
def test_gluon_kernels_compile_for_sm90a_without_spills(H, V, R):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", COMPILE, json.dumps([H, V, R])], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report) == ({"forward", "dkv"} if R >= 64 else {"forward"})
    for name, used in report.items():
        assert used["spill_bytes"] == 0 and used["stack_bytes"] == 0, (name, used)
        assert 0 < used["shared_bytes"] <= hopper.SHARED_BYTES, (name, used)
        assert used["registers"] <= 255, (name, used)


def test_shapes_the_gluon_tiles_do_not_take_stay_on_triton():
    bf16 = torch.bfloat16
    assert hopper.forward_fits(128, 512, 64, bf16)
    assert not hopper.forward_fits(128, 512, 64, torch.float32)  # bf16 MMAs only
    assert not hopper.forward_fits(96, 512, 64, bf16)  # whole 64-head blocks
    assert not hopper.forward_fits(128, 384, 64, bf16)  # power-of-two value width
    assert not hopper.forward_fits(128, 512, 128, bf16)  # q and a pair's two slots exceed shared memory
    assert not hopper.forward_fits(128, 64, 64, bf16) and not hopper.forward_fits(128, 512, 16, bf16)  # not run yet
    assert hopper.forward_fits(64, 256, 32, bf16) and not hopper.dkv_fits(64, 256, 32, 2048, bf16)
    assert hopper.dkv_fits(128, 512, 64, 2048, bf16)
    assert not hopper.dkv_fits(128, 512, 64, 2000, bf16)  # whole slot blocks
    assert not hopper.dkv_fits(128, 512, 48, 2048, bf16)  # one power-of-two rope MMA
    assert not hopper.dkv_fits(512, 512, 64, 2048, bf16)  # p, ds, q and dO of all heads exceed shared memory
    q_BTHK, kv_BTK = torch.zeros(1, 4, 64, 576, dtype=bf16), torch.zeros(1, 4, 576, dtype=bf16)
    assert not hopper.use_forward(q_BTHK, kv_BTK, 512)  # CPU tensors


def sparse_problem(B, T, H, V, R, S, seed):
    """bf16 CUDA inputs with 20% of the causal slots dropped to -1, and dO."""
    q_BTHK, kv_BTK, idx_BTS = random_sparse_problem(B, T, H, V + R, S, torch.float32, seed=seed)
    idx_BTS = with_dropped_slots(idx_BTS, 0.2, seed=seed + 1)
    do_BTHV = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(seed + 2))
    return [t.cuda() for t in (q_BTHK.bfloat16(), kv_BTK.bfloat16(), idx_BTS, do_BTHV.bfloat16())]


def run(q_BTHK, kv_BTK, idx_BTS, do_BTHV, V, fn, dtype):
    q, kv = q_BTHK.to(dtype).requires_grad_(), kv_BTK.to(dtype).requires_grad_()
    o_BTHV = fn(q, kv, idx_BTS, (q.shape[-1]) ** -0.5, V)
    o_BTHV.backward(do_BTHV.to(dtype))
    return o_BTHV, q.grad, kv.grad


# S 128: both Gluon kernels; S 96: the forward masks a partial last step, the dkv pass stays on Triton
@on_hopper
@pytest.mark.parametrize("B,T,H,V,R,S", [(2, 300, 128, 512, 64, 128), (1, 200, 64, 256, 32, 96)])
def test_gluon_kernels_match_reference_and_triton(B, T, H, V, R, S, monkeypatch):
    problem = sparse_problem(B, T, H, V, R, S, seed=3)
    expected = run(*problem, V, ref.sparse_attention, torch.float64)
    used = []
    for name in ("sparse_attention_fwd", "dkv_pass"):
        monkeypatch.setattr(hopper, name, (lambda f, n: lambda *a: (used.append(n), f(*a))[1])(getattr(hopper, name), name))
    actual = run(*problem, V, kernels.sparse_attention, torch.bfloat16)
    # called, and compiled: a launcher that fell back to Triton would leave its name here
    assert not {"DSA forward", "DSA dkv"} & gluon_fallback.FAILED
    assert used.count("sparse_attention_fwd") == 1
    assert used.count("dkv_pass") == (1 if S % hopper.DKV_SLOTS == 0 else 0)
    for label, a, e in zip(("o", "dq", "dkv"), actual, expected):
        assert_close(a, e, "dsa_attention", torch.bfloat16, "out" if label == "o" else "grad", label)
    # the Triton kernels on the same inputs: only rounding and the atomics' order differ
    monkeypatch.setattr(hopper, "use_forward", lambda *a: False)
    monkeypatch.setattr(hopper, "use_dkv", lambda *a: False)
    triton_results = run(*problem, V, kernels.sparse_attention, torch.bfloat16)
    for label, a, t in zip(("o", "dq", "dkv"), actual, triton_results):
        rel_rms = ((a.float() - t.float()).square().sum() / t.float().square().sum()).sqrt().item()
        assert rel_rms < 1e-3, (label, rel_rms)
