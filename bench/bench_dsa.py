"""DSA benchmark: indexer top-k + sparse MLA attention (fwd + bwd) vs dense causal MLA via SDPA.

Shape legend: B batch, T tokens, H heads, K key width, V value width, S selected keys,
I indexer heads, J indexer head width, N queries of the correctness subset.

    PYTHONUNBUFFERED=1 python bench/bench_dsa.py [--T 32768] [--out DIR] [--dense-backends flash,efficient,cudnn]

Correctness: bf16 kernels vs the fp64 reference on the same bf16 inputs, on a subset of query
tokens (the full fp64 reference does not fit at T=32768): outputs and dq on those rows, dkv from
an upstream gradient that is zero outside them. Indexer: overlap of the selected sets with the
fp64 top-k on those rows. Timings: CUDA events, median (bench/timing.py); TFLOP/s by the FLOP
counts of `flops`. Writes dsa.json (dsa-<T>.json for --T other than 32768) under --out. What was tried:
`git show 99a26d7:bench/NOTES.md`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.timing import peak_gib, time_ms  # noqa: E402
from reference_ops import dsa as ref  # noqa: E402
from runtime.ops.dsa import attention, indexer  # noqa: E402
from runtime.tolerances import compare, tolerance_for  # noqa: E402

H, K, V, QK, VD, I, J, TOPK = 128, 576, 512, 192, 128, 64, 128, 2048


def timed(label, fn, reps):
    ms = time_ms(fn, reps=reps, warmup=1)
    print(f"  {label:<48} {ms:10.2f} ms", flush=True)
    return ms


def try_time(label, fn, reps):
    try:
        return timed(label, fn, reps)
    except Exception as error:  # an SDPA backend that does not take these widths is reported, not fatal
        print(f"  {label:<48} FAILED {type(error).__name__}: {str(error)[:160]}", flush=True)
        return None


SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION}


def dense_baseline(T, backends=tuple(SDPA_BACKENDS)):
    """Dense causal MLA through SDPA, unabsorbed widths: fwd + bwd with the default dispatch (the baseline) and
    with each of `backends` forced."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(1, H, T, QK, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(1, H, T, VD, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    do = torch.randn(1, H, T, VD, device="cuda", dtype=torch.bfloat16, generator=g)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=QK**-0.5).backward(do)

    results = {"default": try_time("SDPA default dispatch fwd+bwd", step, reps=3)}
    for name in backends:
        with sdpa_kernel([SDPA_BACKENDS[name]]):
            results[name] = try_time(f"SDPA {name} fwd+bwd", step, reps=3)
    return results


def sparse_inputs(T):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, T, H, K, device="cuda", generator=g).bfloat16()
    kv = torch.randn(1, T, K, device="cuda", generator=g).bfloat16()
    iq = torch.randn(1, T, I, J, device="cuda", generator=g).bfloat16()
    ik = torch.randn(1, T, J, device="cuda", generator=g).bfloat16()
    # weights_proj runs in fp32 in the release; the heads^-0.5 factor is folded in
    iw = torch.randn(1, T, I, device="cuda", generator=g) * I**-0.5
    return q, kv, iq, ik, iw


def subset_rows(T, n=24):
    """A spread of query rows: early (fewer than TOPK keys), middle and the last ones."""
    return torch.unique(torch.cat([torch.tensor([0, 5, 100, 1500, 2047, 2048, 2049]), torch.linspace(2100, T - 1, n - 7).long()]))


def check_indexer(iq, ik, iw, idx, rows):
    """Overlap of the kernel's selection with the fp64 top-k, and the fp64 score of the worst miss."""
    # the reference formula for a subset of query rows (indexer_scores assumes all T queries)
    logits = torch.einsum("bnhj,btj->bnht", iq[:, rows].double(), ik.double()).relu()
    scores = torch.einsum("bnh,bnht->bnt", iw[:, rows].double(), logits) * J**-0.5
    future = torch.arange(ik.shape[1], device="cuda")[None, :] > rows.cuda()[:, None]
    scores = scores.masked_fill(future[None], float("-inf"))
    expected = ref.topk_indices(scores, TOPK)
    overlaps, gaps = [], []
    for n in range(len(rows)):
        want, got = set(expected[0, n].tolist()) - {-1}, set(idx[0, rows[n]].tolist()) - {-1}
        overlaps.append(len(want & got) / max(1, len(want)))
        threshold = scores[0, n].gather(0, expected[0, n].clamp(min=0)).min()
        picked = scores[0, n].gather(0, torch.tensor(sorted(got), device="cuda"))
        gaps.append(float((threshold - picked.min()).clamp(min=0) / scores[0, n].max().abs()))
    return {"min_overlap": min(overlaps), "mean_overlap": statistics.mean(overlaps), "max_rel_score_gap": max(gaps)}


def check_attention(q, kv, idx, rows, scale):
    """bf16 kernel vs fp64 reference on the same inputs, restricted to query `rows`."""
    do = torch.zeros(1, q.shape[1], H, V, device="cuda", dtype=torch.bfloat16)
    do[:, rows] = torch.randn(1, len(rows), H, V, device="cuda").bfloat16()
    o, lse = attention.sparse_attention_fwd(q, kv, idx, scale, V)
    dq, dkv = attention.sparse_attention_bwd(q, kv, idx, o, lse, do, scale)
    q64, kv64 = q[:, rows].double().requires_grad_(), kv.double().requires_grad_()
    o64 = ref.sparse_attention(q64, kv64, idx[:, rows], scale, V)
    o64.backward(do[:, rows].double())
    out = compare(o[:, rows], o64, tolerance_for("dsa_attention", torch.bfloat16, "out"))
    gq = compare(dq[:, rows], q64.grad, tolerance_for("dsa_attention", torch.bfloat16, "grad"))
    gkv = compare(dkv, kv64.grad, tolerance_for("dsa_attention", torch.bfloat16, "grad"))
    for label, c in (("o", out), ("dq", gq), ("dkv", gkv)):
        print(f"  {label:<4} {c.describe()}", flush=True)
    return {"o": out.rel_rms, "dq": gq.rel_rms, "dkv": gkv.rel_rms, "passed": out.passed and gq.passed and gkv.passed}


def best(results):
    timed = {name: ms for name, ms in results.items() if ms is not None}
    name = min(timed, key=timed.get)
    return name, timed[name]


def flops(T: int) -> dict:
    """Matmul FLOP per (query, selected key, head) of the absorbed sparse attention: forward q.k over
    K and p.v over V; backward the scores again (K), dp (V), dq (K), dkv from ds (K) and from p (V).
    The indexer: q.k over J for each of I heads and each causal pair."""
    pairs = sum(min(t + 1, TOPK) for t in range(T)) * H
    return {"fwd": 2 * pairs * (K + V), "bwd": 2 * pairs * (3 * K + 2 * V), "indexer": 2 * (T * (T + 1) // 2) * I * J}


def bench_ours(T, q, kv, iq, ik, iw, idx, scale):
    print("indexer (scoring + top-k), forward, backward:", flush=True)
    index_ms = timed("indexer_topk", lambda: indexer.indexer_topk(iq, ik, iw, J**-0.5, TOPK), 3)
    fwd_ms = timed("sparse attention fwd", lambda: attention.sparse_attention_fwd(q, kv, idx, scale, V), 5)
    o, lse = attention.sparse_attention_fwd(q, kv, idx, scale, V)
    do = torch.randn_like(o)
    bwd_ms = timed("sparse attention bwd", lambda: attention.sparse_attention_bwd(q, kv, idx, o, lse, do, scale), 3)
    return {"indexer_topk": index_ms, "sparse_fwd": fwd_ms, "sparse_bwd": bwd_ms}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, default=32768)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    # the efficient backend takes 35 s a step at T=131072 (7x the default dispatch): worth leaving out there
    parser.add_argument("--dense-backends", default=",".join(SDPA_BACKENDS),
                        help="SDPA backends timed beside the default dispatch, comma-separated (default: all)")
    args = parser.parse_args()
    backends = [name for name in args.dense_backends.split(",") if name]
    unknown = sorted(set(backends) - set(SDPA_BACKENDS))
    if unknown:
        parser.error(f"--dense-backends: unknown {', '.join(unknown)}; choose from {', '.join(SDPA_BACKENDS)}")
    T, scale = args.T, QK**-0.5
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} T={T}", flush=True)
    q, kv, iq, ik, iw = sparse_inputs(T)
    idx = indexer.indexer_topk(iq, ik, iw, J**-0.5, TOPK)
    rows = subset_rows(T)
    print("correctness on query rows", rows.tolist(), flush=True)
    index_check = check_indexer(iq, ik, iw, idx, rows)
    print(f"  indexer {index_check}", flush=True)
    attention_check = check_attention(q, kv, idx, rows, scale)
    breakdown = bench_ours(T, q, kv, iq, ik, iw, idx, scale)
    peak = peak_gib()
    del q, kv, iq, ik, iw, idx
    torch.cuda.empty_cache()
    print("dense causal MLA via SDPA (q/k 192, v 128, 128 heads):", flush=True)
    dense_ms = dense_baseline(T, backends)
    ours_ms = sum(breakdown.values())
    baseline_ms = dense_ms["default"]
    fastest_dense = best(dense_ms)
    work = flops(T)
    result = {
        "name": "dsa", "device": torch.cuda.get_device_name(), "T": T,
        "shape": f"B1 T{T} H{H} absorbed K{K} V{V} top-k {TOPK}; indexer {I}x{J} bf16; dense baseline q/k {QK} v {VD}",
        "baseline": "dense causal MLA, torch SDPA default dispatch, bf16, fwd+bwd",
        "baseline_ms": baseline_ms, "ours_ms": ours_ms, "speedup": baseline_ms / ours_ms,
        "speedup_vs_fastest_sdpa_backend": fastest_dense[1] / ours_ms, "fastest_sdpa_backend": fastest_dense[0],
        "fwd_tflops": work["fwd"] / breakdown["sparse_fwd"] / 1e9, "bwd_tflops": work["bwd"] / breakdown["sparse_bwd"] / 1e9,
        "indexer_tflops": work["indexer"] / breakdown["indexer_topk"] / 1e9,
        "max_rel_err": max(attention_check[k] for k in ("o", "dq", "dkv")), "peak_mem_gib": peak,
        "breakdown_ms": breakdown, "dense_ms": dense_ms,
        "correctness": {"attention_rel_rms": attention_check, "indexer": index_check},
        "command": " ".join(["PYTHONUNBUFFERED=1 python bench/bench_dsa.py --T", str(T), "--out $OUT"]
                            + (["--dense-backends", args.dense_backends] if backends != list(SDPA_BACKENDS) else [])),
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
    }
    print(f"\n{'part':<22}{'ms':>10}")
    for part, ms in breakdown.items():
        print(f"{part:<22}{ms:10.2f}")
    print(f"{'ours total':<22}{ours_ms:10.2f}\n{'dense SDPA (default)':<22}{baseline_ms:10.2f}\n"
          f"speedup {result['speedup']:.2f}x (vs fastest SDPA backend {fastest_dense[0]}: "
          f"{result['speedup_vs_fastest_sdpa_backend']:.2f}x); fwd {result['fwd_tflops']:.0f}, bwd {result['bwd_tflops']:.0f} TFLOP/s")
    os.makedirs(args.out, exist_ok=True)
    name = "dsa.json" if T == 32768 else f"dsa-{T}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(result, f, indent=2)
    return 0 if attention_check["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
