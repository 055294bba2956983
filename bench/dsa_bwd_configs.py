"""DSA backward configs timed and checked one process each, so that a config which faults the GPU (an illegal
memory access, seen at 64 heads per program under triton 3.6) cannot take the others down with it.

    PYTHONUNBUFFERED=1 python bench/dsa_bwd_configs.py --T 32768 --out $OUT '{"BH": 32, "BS": 32}' '{"BH": 64, ...}'

Each config: the backward at bench_dsa.py's shapes on its inputs (indexer top-k, default forward), its dq and dkv
against the fp64 reference on bench_dsa's subset of query rows, and its median time over 3 calls. Writes
dsa-bwd-configs.json under --out: per config its result or the error that ended its process.
The 18:46 run (bench/results/2026-11-29-dsa-bwd-configs-1846.json) timed the dkv_t and split keywords of commit
14c020e, since removed (bench_dsa.py's docstring has the figures); sparse_attention_bwd takes BH, BS, num_warps and
num_stages now and refuses other keys.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import bench_dsa as dsa  # noqa: E402
from reference_ops import dsa as ref  # noqa: E402
from runtime.kernels.sparse_attention import attention, indexer  # noqa: E402
from runtime.tolerances import compare, tolerance_for  # noqa: E402


def run_one(config: dict, T: int) -> dict:
    scale = dsa.QK**-0.5
    q, kv, iq, ik, iw = dsa.sparse_inputs(T)
    idx = indexer.indexer_topk(iq, ik, iw, dsa.J**-0.5, dsa.TOPK)
    rows = dsa.subset_rows(T)
    o, lse = attention.sparse_attention_fwd(q, kv, idx, scale, dsa.V)
    do = torch.zeros_like(o)
    do[:, rows] = torch.randn(1, len(rows), dsa.H, dsa.V, device="cuda").bfloat16()
    dq, dkv = attention.sparse_attention_bwd(q, kv, idx, o, lse, do, scale, **config)
    q64, kv64 = q[:, rows].double().requires_grad_(), kv.double().requires_grad_()
    ref.sparse_attention(q64, kv64, idx[:, rows], scale, dsa.V).backward(do[:, rows].double())
    gq = compare(dq[:, rows], q64.grad, tolerance_for("sparse_attention", torch.bfloat16, "grad"))
    gkv = compare(dkv, kv64.grad, tolerance_for("sparse_attention", torch.bfloat16, "grad"))
    do = torch.randn_like(o)
    ms = dsa.time_ms(lambda: attention.sparse_attention_bwd(q, kv, idx, o, lse, do, scale, **config), reps=3)
    return {"ms": ms, "dq_rel_rms": gq.rel_rms, "dkv_rel_rms": gkv.rel_rms, "passed": gq.passed and gkv.passed}


def run_isolated(config: dict, T: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", json.dumps(config), "--T", str(T)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    return {"error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1][:300]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("configs", nargs="*", help="backward configs as JSON objects (sparse_attention_bwd's keywords)")
    parser.add_argument("--T", type=int, default=32768)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one), args.T)))
        return 0
    results = {}
    for text in args.configs:
        results[text] = run_isolated(json.loads(text), args.T)
        print(f"{text:<90} {results[text]}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dsa-bwd-configs.json"), "w") as f:
        json.dump({"name": "dsa-bwd-configs", "device": torch.cuda.get_device_name(), "T": args.T,
                   "command": "python bench/dsa_bwd_configs.py --T %d CONFIGS" % args.T, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
