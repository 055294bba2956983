"""DSA benchmark: indexer top-k + sparse MLA attention (fwd + bwd) vs dense causal MLA via SDPA.

Shape legend: B batch, T tokens, H heads, K key width, V value width, S selected keys,
I indexer heads, J indexer head width, N queries of the correctness subset.

    PYTHONUNBUFFERED=1 python bench/bench_dsa.py [--T 32768] [--out DIR]

Correctness: bf16 kernels vs the fp64 reference on the same bf16 inputs, on a subset of query
tokens (the full fp64 reference does not fit at T=32768): outputs and dq on those rows, dkv from
an upstream gradient that is zero outside them. Indexer: overlap of the selected sets with the
fp64 top-k on those rows. Timings: CUDA events, median. Writes dsa.json under --out.

Why the 3x target (TARGETS.md) is out of reach at these widths, by FLOP count (T=32768, H=128):
- dense causal MLA (the baseline, per-head q/k 192, v 128): T^2/2 = 5.4e8 pairs x H x (192 + 128) x 2 =
  4.4e13 FLOP forward, ~3.5x that forward+backward = 1.54e14; cuDNN does it in 307 ms, ~500 TFLOP/s.
- sparse MLA must use the absorbed form (all heads share the gathered 576-wide latent row; per-head k/v
  rows would mean gathering 2048 x 128 x 320 values per token): T x 2048 = 6.7e7 pairs x H x (576 + 512)
  x 2 = 1.87e13 forward, ~6.5e13 forward+backward, plus the indexer's T^2/2 x 64 x 128 x 2 = 8.8e12.
- so dense / sparse work = 1.54e14 / 7.4e13 = 2.1: at cuDNN's own efficiency DSA would be ~2x, and 3x
  would need ~1.5x cuDNN's FLOP rate from gathered tiles and atomically accumulated dkv.
- the backward alone (~4.7e13 FLOP) at the best published Hopper sparse MLA backward rate (~115 TFLOP/s,
  TARGETS.md) takes ~410 ms, more than the whole dense baseline.

Why our backward runs at ~86 TFLOP/s (ptxas for sm_90a offline, bench/kernel_resources.py with the launch's
divisibility hints): BH=32 heads is below the 64 rows of a warpgroup, so Triton emits mma.sync, not wgmma; 255
registers with 104 B spilled; dkv goes out as 4-wide fp32 reductions (red.global.add.v4.f32), ~620 GB of them
at BH=32 (each of the 4 head blocks adds its own partial). A transposed form with keys as the rows of every
tile (wgmma throughout, dkv added in column chunks) was built and timed on 2026-11-29 at 18:24
(bench/results/2026-11-29-dsa-keys-major-1824.txt): 691.9 ms against 553.6 for the heads-major kernel at BS64 /
chunks of 64 (240 B spilled, one stage: two do not fit in shared memory), and an illegal memory access on the
H200 at chunks of 32 that the interpreter did not show. Removed (commits 346b155, f498b80 hold it). 64 heads per program
(half the reductions) fit only with dkv transposed, below, and measured no faster.
The grid: one 1-D program index with a token's head blocks adjacent (attention._token_and_head0), so the four
programs of a token gather the same kv rows and add into the same dkv rows at about the same time, through L2:
backward 503.7 against 550.9 ms with the grid walking all tokens once per head block (predicted 450-520), forward
70.96 against 70.45 (18:28 run, bench/results/2026-11-29-dsa.json: 601.7 ms in all against dense 304.1 = 0.51x).
Each token's indices sorted into key order (the same set; predicted bwd 504 -> 350-450 ms, as tokens running
together would walk the key range in step through L2): bwd 500.4 against 503.7, fwd 71.8 against 70.9, plus 1.8 ms
for the sort (18:37 run, bench/results/2026-11-29-dsa-sorted-indices-1837.json, by this script at commit
d0f7be8 with its sorted_keys() timing): no gain, not adopted. That run: 602.1 ms in all against dense 304.6 = 0.51x.
64 heads per program with wgmma products (18:46 run, bench/dsa_bwd_configs.py at commit 14c020e,
bench/results/2026-11-29-dsa-bwd-configs-1846.json): computing dkv as its transpose q^T ds lets one shared-memory copy
of q and dO serve both products, so 64 heads fit (ptxas: 180 KB at one stage, 229 KB at two, wgmma only, 1.6-2.1 KB
spilled); dq and dkv in two launches ("split") each recompute p and dp. Measured against 513.8 ms for the default
on that host: 64 heads one pass 507.3 (two stages), split 531.5; 32 heads with dkv transposed 528.6, split 985.5;
at one stage 64 heads hit an illegal memory access in one pass and gave a wrong dkv (rel RMS 305) split, where the
interpreter passes: triton 3.6 miscompiles them. Nothing faster that is right: removed (commits df778d3, 14c020e).
So after the grid change neither the reductions' L2 locality nor wgmma against mma.sync moves the backward. ncu on
one backward at T=8192 (18:46, bench/profile_dsa_bwd.py, bench/results/2026-11-29-dsa-bwd-ncu.txt; at T=8192 the
fp32 dkv buffer fits in L2): one 8-warp program per SM (registers and shared memory: 12.5% occupancy), no eligible
warp in 78% of cycles, L1/TEX (shared memory and the 10M spill requests) at 67% of its throughput, shared-memory
(MIO) waits the largest stall (33%), L2 hit rate 97.9%, DRAM 0.6%, SM compute 23%. Its time follows each program's
chain through shared memory at one program per SM, not bandwidth.
Two programs per SM at 16 heads (4 warps, ptxas: 255 registers, 52-496 B spilled, 86-105 KB shared; a token's 8
head blocks adjacent, so their gathers and reductions are L2 hits) measured slower all the same: BS16 607.2 ms,
BS32 803.6, BS32 at 8 warps (one per SM, no spills) 709.7, against the default's 499.6 (19:03 run,
bench/dsa_bwd_configs.py, bench/results/2026-11-29-dsa-bwd-configs-1903.json): halving the heads halves each
program's work per gathered row and doubles the gathers and reductions, which costs more than the second program
gains. A second program per SM at 32 heads would need the registers and shared memory of today's 16.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from reference_ops import dsa as ref
from runtime.kernels.sparse_attention import attention, indexer
from runtime.tolerances import compare, tolerance_for

H, K, V, QK, VD, I, J, TOPK = 128, 576, 512, 192, 128, 64, 128, 2048
# Configs timed on the H200 on 2026-11-29 and dropped (ms at T=32768): fwd BH64/BS32 4 and 8 warps
# (213, 105), BH32/BS32 (121), BH64/BS128 (shared memory overflow); bwd BH16/BS32 4 and 8 warps (915, 942),
# BH32/BS32 4 warps (755), BH32/BS16 (818), BH16/BS64 (3829); bwd BH64 overflows shared memory.
FWD_CONFIGS = [dict(BH=64, BS=64, num_warps=8), dict(BH=64, BS=64, num_warps=8, num_stages=3)]
BWD_CONFIGS = [dict(BH=32, BS=32, num_warps=8, num_stages=1), dict(BH=32, BS=32, num_warps=8, num_stages=2)]
INDEXER_CONFIGS = [dict(BQ=64, BT=128, num_warps=8), dict(BQ=128, BT=128, num_warps=8)]


def time_ms(fn, reps=5, warmup=1):
    """Median wall time of fn() in ms over `reps` CUDA-event timed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def try_time(label, fn, reps):
    try:
        ms = time_ms(fn, reps=reps)
        print(f"  {label:<48} {ms:10.2f} ms", flush=True)
        return ms
    except Exception as error:  # a config that does not compile or fit is reported, not fatal
        print(f"  {label:<48} FAILED {type(error).__name__}: {str(error)[:160]}", flush=True)
        return None


def dense_baseline(T):
    """Dense causal MLA through SDPA, unabsorbed widths: fwd + bwd per SDPA backend."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(1, H, T, QK, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(1, H, T, VD, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    do = torch.randn(1, H, T, VD, device="cuda", dtype=torch.bfloat16, generator=g)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=QK**-0.5).backward(do)

    results = {"default": try_time("SDPA default dispatch fwd+bwd", step, reps=3)}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel([backend]):
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
    out = compare(o[:, rows], o64, tolerance_for("sparse_attention", torch.bfloat16, "out"))
    gq = compare(dq[:, rows], q64.grad, tolerance_for("sparse_attention", torch.bfloat16, "grad"))
    gkv = compare(dkv, kv64.grad, tolerance_for("sparse_attention", torch.bfloat16, "grad"))
    for label, c in (("o", out), ("dq", gq), ("dkv", gkv)):
        print(f"  {label:<4} {c.describe()}", flush=True)
    result = {"o": out.rel_rms, "dq": gq.rel_rms, "dkv": gkv.rel_rms, "passed": out.passed and gq.passed and gkv.passed}
    # every timed backward config against the same fp64 gradients (the tiles change the summation order)
    result["bwd_configs"] = {}
    for config in BWD_CONFIGS:
        dq, dkv = attention.sparse_attention_bwd(q, kv, idx, o, lse, do, scale, **config)
        gq = compare(dq[:, rows], q64.grad, tolerance_for("sparse_attention", torch.bfloat16, "grad"))
        gkv = compare(dkv, kv64.grad, tolerance_for("sparse_attention", torch.bfloat16, "grad"))
        result["bwd_configs"][str(config)] = {"dq": gq.rel_rms, "dkv": gkv.rel_rms, "passed": gq.passed and gkv.passed}
        print(f"  bwd {config}: dq {gq.rel_rms:.2e} dkv {gkv.rel_rms:.2e} {'ok' if gq.passed and gkv.passed else 'FAILED'}",
              flush=True)
        result["passed"] = result["passed"] and gq.passed and gkv.passed
    return result


def best(results):
    timed = {name: ms for name, ms in results.items() if ms is not None}
    name = min(timed, key=timed.get)
    return name, timed[name]


def bench_ours(T, q, kv, iq, ik, iw, idx, scale):
    print("indexer (scoring + top-k):", flush=True)
    index_ms = {str(c): try_time(f"indexer_topk {c}", lambda c=c: indexer.indexer_topk(iq, ik, iw, J**-0.5, TOPK, **c), 3)
                for c in INDEXER_CONFIGS}
    scores = indexer.block_scores(iq, ik, iw, J**-0.5, T - 4096, T)
    index_ms["topk_only_last_block"] = try_time("torch.topk of the last 4096-query block", lambda s=scores: s.topk(TOPK, dim=-1), 3)
    del scores
    print("sparse attention forward:", flush=True)
    fwd_ms = {str(c): try_time(f"fwd {c}", lambda c=c: attention.sparse_attention_fwd(q, kv, idx, scale, V, **c), 5)
              for c in FWD_CONFIGS}
    o, lse = attention.sparse_attention_fwd(q, kv, idx, scale, V)
    do = torch.randn_like(o)
    print("sparse attention backward:", flush=True)
    bwd_ms = {str(c): try_time(f"bwd {c}", lambda c=c: attention.sparse_attention_bwd(q, kv, idx, o, lse, do, scale, **c), 3)
              for c in BWD_CONFIGS}
    return index_ms, fwd_ms, bwd_ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, default=32768)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    T, scale = args.T, QK**-0.5
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} T={T}", flush=True)
    q, kv, iq, ik, iw = sparse_inputs(T)
    idx = indexer.indexer_topk(iq, ik, iw, J**-0.5, TOPK)
    rows = subset_rows(T)
    print("correctness on query rows", rows.tolist(), flush=True)
    index_check = check_indexer(iq, ik, iw, idx, rows)
    print(f"  indexer {index_check}", flush=True)
    attention_check = check_attention(q, kv, idx, rows, scale)
    index_ms, fwd_ms, bwd_ms = bench_ours(T, q, kv, iq, ik, iw, idx, scale)
    del q, kv, iq, ik, iw, idx
    torch.cuda.empty_cache()
    print("dense causal MLA via SDPA (q/k 192, v 128, 128 heads):", flush=True)
    dense_ms = dense_baseline(T)
    index_best = best({k: v for k, v in index_ms.items() if k != "topk_only_last_block"})
    fwd_best, bwd_best = best(fwd_ms), best(bwd_ms)
    ours_ms = index_best[1] + fwd_best[1] + bwd_best[1]
    baseline_ms = dense_ms["default"]
    fastest_dense = best(dense_ms)
    result = {
        "name": "dsa", "device": torch.cuda.get_device_name(),
        "shape": f"B1 T{T} H{H} absorbed K{K} V{V} top-k {TOPK}; indexer {I}x{J} bf16; dense baseline q/k {QK} v {VD}",
        "baseline": "dense causal MLA, torch SDPA default dispatch, bf16, fwd+bwd",
        "baseline_ms": baseline_ms, "ours_ms": ours_ms, "speedup": baseline_ms / ours_ms,
        "speedup_vs_fastest_sdpa_backend": fastest_dense[1] / ours_ms, "fastest_sdpa_backend": fastest_dense[0],
        "max_rel_err": max([attention_check[k] for k in ("o", "dq", "dkv")]
                           + [c[k] for c in attention_check["bwd_configs"].values() for k in ("dq", "dkv")]),
        "breakdown_ms": {"indexer_topk": index_best, "sparse_fwd": fwd_best, "sparse_bwd": bwd_best},
        "all_ms": {"indexer": index_ms, "fwd": fwd_ms, "bwd": bwd_ms, "dense": dense_ms},
        "correctness": {"attention_rel_rms": attention_check, "indexer": index_check},
        "command": "PYTHONUNBUFFERED=1 python bench/bench_dsa.py --T %d" % T,
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
    }
    print(f"\n{'part':<22}{'ms':>10}  config")
    for part, (config, ms) in result["breakdown_ms"].items():
        print(f"{part:<22}{ms:10.2f}  {config}")
    print(f"{'ours total':<22}{ours_ms:10.2f}\n{'dense SDPA (default)':<22}{baseline_ms:10.2f}\n"
          f"speedup {result['speedup']:.2f}x (vs fastest SDPA backend {fastest_dense[0]}: {result['speedup_vs_fastest_sdpa_backend']:.2f}x)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dsa.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0 if attention_check["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
