"""RMSNorm benchmark: the runtime's fused kernels (runtime/ops/norm/kernel.py) vs the torch form (runtime/ops/norm/torch_form.py,
what every norm ran before) and fla 0.6.0's fused norms, bf16, one GPU, at the LoRA slice's shapes.

    PYTHONUNBUFFERED=1 python bench/bench_norm.py [--out DIR]

Cases: the decoder's RMSNorm over [4096, 2048] ("1+w" weights) and Qwen3-Next's gated output norm over
[4096, 32, 128] (silu gate); forward+backward with the weight frozen (the LoRA case: dx and d(gate) only) and
with its gradient. Timings: the step captured once as a CUDA graph and replayed (bench/timing.py: CUDA events,
median), so that they are GPU time: an eager call of a kernel this short is the host's launch time. Correctness: each implementation in bf16 vs
the fp64 reference (reference_ops/norms.py) on the same inputs, output and every gradient. Writes norm.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import captured, time_ms
from reference_ops import norms as reference
from runtime.ops.norm import kernel as kernels
from runtime.ops.norm import torch_form
from runtime.tolerances import compare, tolerance_for

EPS = 1e-6
CASES = {"rms_norm T4096 D2048 1+w": ((4096, 2048), False), "gated_rms_norm T4096 H32 D128 silu": ((4096, 32, 128), True)}


def implementations(gated: bool) -> dict:
    impls = {"ours": kernels.gated_rms_norm if gated else kernels.rms_norm,
             "torch": torch_form.gated_rms_norm if gated else torch_form.rms_norm}
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.modules.norm.layernorm import rms_norm
    except ImportError:
        return impls
    if gated:
        impls["fla"] = lambda x, gate, weight, eps: rms_norm_gated(x, gate, weight, None, "swish", eps=eps)
    else:
        # fla's norm takes the weight as it multiplies: "1+w" is passed as 1 + w
        impls["fla"] = lambda x, weight, eps, offset: rms_norm(x, weight + offset, None, eps=eps)
    return impls


def inputs(shape, gated: bool, weight_grad: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    t = {"x": torch.randn(shape, device="cuda", generator=g).bfloat16().requires_grad_(),
         "weight": (torch.randn(shape[-1], device="cuda", generator=g) * 0.1).bfloat16().requires_grad_(weight_grad)}
    if gated:
        t["gate"] = (torch.randn(shape, device="cuda", generator=g) * 2).bfloat16().requires_grad_()
    return t


def call(fn, t: dict, gated: bool):
    if gated:
        return fn(t["x"], t["gate"], t["weight"], EPS)
    return fn(t["x"], t["weight"], EPS, 1.0)


def errors(fn, shape, gated: bool) -> dict:
    """rel RMS of the output and every gradient against the fp64 reference, same bf16 inputs."""
    t = inputs(shape, gated, True)
    ref_in = {n: v.detach().double().requires_grad_() for n, v in t.items()}
    out, expected = call(fn, t, gated), call(reference.gated_rms_norm if gated else reference.rms_norm, ref_in, gated)
    cot = torch.randn_like(expected)
    out.backward(cot.bfloat16())
    expected.backward(cot)
    pairs = {"out": (out, expected)} | {n: (t[n].grad, ref_in[n].grad) for n in t}
    res = {}
    for name, (got, want) in pairs.items():
        c = compare(got, want, tolerance_for("gated_rms_norm" if gated else "rms_norm", torch.bfloat16,
                                             "out" if name == "out" else "grad"))
        res[name] = {"rel_rms": c.rel_rms, "max_abs_rel": c.max_abs_rel, "passed": c.passed}
    return res


def timings(fn, shape, gated: bool) -> dict:
    res = {}
    for label, weight_grad in (("frozen_weight", False), ("weight_grad", True)):
        t = inputs(shape, gated, weight_grad)
        dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

        def step():
            for v in t.values():
                v.grad = None
            call(fn, t, gated).backward(dy)
        res[f"fwd_bwd_{label}_ms"] = graphed_ms(step)
    t = inputs(shape, gated, False)

    def forward():
        with torch.no_grad():
            call(fn, t, gated)
    res["fwd_ms"] = graphed_ms(forward)
    return res


def graphed_ms(step) -> float:
    """Median time of one replay of `step` captured as a CUDA graph (after warm-up calls on a side stream)."""
    return time_ms(captured(step, warmup=3).replay, reps=50, warmup=5)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    result = {"name": "norm", "device": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
              "command": "PYTHONUNBUFFERED=1 python bench/bench_norm.py --out $OUT",
              "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__}, "cases": {}}
    for case, (shape, gated) in CASES.items():
        result["cases"][case] = {name: timings(fn, shape, gated) | {"errors": errors(fn, shape, gated)}
                                 for name, fn in implementations(gated).items()}
        print(case, json.dumps(result["cases"][case]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "norm.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
