"""Benchmark of the fused GDN and KDA Triton kernels against transformers' torch path and fla's forward.

Checks our bf16 kernels against an fp64 reference at the benchmark shape (the chunked torch form of
runtime/ops/gated_delta.py run in fp64, which the CPU tests show equals the token loop of
reference_ops/ to ~1e-15), then times forward and forward+backward with CUDA events (warm-up, median).
Prints a table and writes gdn.json, kda.json, raw.json and, with --variants, variants.json into --out.

    python3 bench/bench_gated_delta.py --out DIR [--seq-len 8192 --heads 32 --dim 128] [--variants [NAMES]]

--variants times every KernelVariant of runtime/kernels/gated_delta.VARIANTS (or the comma-separated
NAMES) side by side with the default in the same process, each with its own precision check against
the same fp64 reference and its per-launch breakdown; "default" is timed again in that loop. Most
promising first; each kind's variants stop at its share of --budget-s (JSON is written after every
step), so one run fits the device's 10-minute limit with what matters measured.

--backward-settings times the default with each launch-constant set of gated_delta.backward.SETTINGS.
Per-kernel GPU times come from torch.profiler (`kernel_profile`), also for fla's forward.

History at B1 T8192 H32 K=V=128 bf16 (predicted -> measured, H200, 2026-11-29, fwd+bwd ms):
- first default (fp32 tiles, in-chunk diagonals, recomputation): GDN 8.77, KDA 52.0.
- variants run (bench/results/2026-11-29-gdn-kda-variants.json): bf16_tiles 7.5 -> 7.41, bf16 tiles and
  states 7.0 -> 7.14, 8-warp scans 8.1 -> 9.01 (worse), bf16 pipelined scans 5.8 -> 6.59, split
  diagonal 8.3 -> 8.24, keep_forward 6.6 -> 6.83, all of them 4.2 -> 4.70 (GDN fwd 1.68; per kernel:
  prep 0.80, scan 0.45, output 0.22, scan_bwd 0.65, grad 2.30); KDA keep_forward 38.6 (predicted
  38.5). "all" became the default. fla 0.6.0's forward in the same run: GDN 0.90 ms (h-scan 0.157,
  output 0.133, kkt+solve 0.099, w/u 0.083, l2norm 0.064 GPU ms), KDA 1.37 ms.
- since then the forward (prep in [C, 64] column blocks with a doubling inverse, bf16 products in the
  scan and output kernels, u kept fp32) and the backward (grad_kernel split into state_grad, wy_grad
  and finish kernels; diag_grad for KDA): predictions in runtime/kernels/gated_delta/forward.py and
  backward.py docstrings. Measured at 11:28 (commit e5a6f98): GDN 3.82 ms (prep 0.63, wy_grad 0.88,
  state_grad 0.88 against predicted 0.25-0.30 / 0.30 / 0.35: one 255-register program per SM exposes each
  program's chain of dependent steps), KDA 12.5 ms.
- final run (commit 7b59e80, two processes: --kinds gdn / --kinds kda): GDN bf16_grads 3.43 ms (wy_grad
  0.88 -> 0.49; predicted 0.65-0.75), state_key_block_32 3.61, base 3.87; KDA token_diag_unblocked 7.57
  ms (diag 2.50 -> 0.38, diag_grad 3.16 -> 0.84; predicted 0.15-0.25 and 0.30-0.45), token_diag 8.03,
  base 12.63. Those two became the per-kind defaults (function.default_variant). That run's GDN
  baseline took 217.8 ms and fla's forward 1.47 ms, ~1.5x their earlier figures (host-bound launches on
  a slower host), while ours timed as before: the 63.5x of that run is ~40x against the earlier baseline.
- 13:05 (commit c998a58, the batched chunk layout built once per shape instead of ~15 small launches per
  call): GDN forward 1.52 -> 1.01 ms (fla 0.94 in the same run), fwd+bwd 2.91 ms against 171.1 = 58.9x;
  KDA 7.10 ms against 1338.8 = 188.6x. Host issue time (`host_issue_ms`): GDN forward 0.24 ms for 0.77 ms of
  kernels, fwd+bwd 1.36 for 2.58; bench/launch_overhead.py then measured 64 us of host time per Triton launch
  (26 through the compiled kernel's launcher: runtime/kernels/launch.py).
- 13:40 (helper-bwd snapshot, before the layout cache): KDA gram_grad_apart, the per-channel decayed Gram
  backward in its own kernel: 7.47 -> 6.53 ms, with bf16 wy_grad products 6.23, and state_grad key block 32
  6.20 (state_grad 1.57 -> 0.80, wy_grad 1.93 -> 0.57, gram_grad 0.78; predicted in backward.py). Nested
  per-channel Gram products in prep (kda_nested) were slower: prep 1.16 -> 3.22 ms (fwd+bwd 9.66;
  bench/results/2026-11-29-kda-nested-1340.json).
- 14:08 and 14:20 (main with the fast launches of runtime/kernels/launch.py, gram_grad_apart the KDA default):
  GDN 2.85 / 2.79 ms against baselines of 231.1 / 146.3 ms (host-bound; 79.5x and 53.2x), forward 0.93 / 0.85
  against fla 0.94 / 1.27; state_grad key block 32 2.84 / 2.82, prep in two launches 3.20-3.38 (slower). KDA
  5.76 / 5.56; prep in two launches with the column kernel reading the first launch's inverse norms, 64 columns
  per program: 5.25 (its column kernel 0.35, against 0.60 recomputing the norms at 32 columns; predicted
  0.1-0.2), adopted; nested products with tf32 inside the diagonal blocks 6.24 (removed).
- 14:22 (commit d858d36, the adopted KDA default): 5.21 ms against 1346.1 = 258.6x.
- 16:22 (bench/results/2026-11-29-gdn-kda-variants-1622.json): three flags from helpers, each predicted in its
  KernelVariant comment. stored_norms (the backward reads prep's inverse norms): GDN 2.81 against 2.79 (state_grad
  0.79 -> 0.77, predicted 0.72-0.77), KDA 5.19 against 5.27 (diag_grad_token 0.80 -> 0.61, predicted 0.6-0.75).
  fused_finish (GDN's finish in wy_grad's tail): 2.84 (wy_grad 0.49 -> 0.67 for finish's 0.14; predicted
  0.54-0.60). scan_output (o in the forward scan): GDN 2.80 (scan 0.26 -> 0.36 for output's 0.10; predicted
  0.33-0.35), 8 warps 2.85. Together with state_grad key block 32: GDN 2.72, KDA with stored norms and scan_output
  5.12 (5.27): adopted (fewer launches; kernel sums 2.49 against 2.55 and 4.79 against 4.94).
- 16:29 (commit 6c961a8, the adopted defaults): GDN 2.71 ms against 195.3 = 72.1x (forward 0.92, fla 1.46); KDA
  5.04 against 1320.3 = 262.2x.
- 16:47 (bench/results/2026-11-29-gdn-scan-stages-1647.json): after ncu saw the scans at one program per SM,
  idle 79-86% of cycles (bench/profile_gdn_step.py), the scans without pipelining (37-41 KB of shared memory
  instead of 139) and in value blocks of 16 (two programs per SM): default 2.67 ms, scan_stages 1 3.13 (scan 0.37
  -> 0.61, scan_bwd 0.35 -> 0.53), with value blocks of 16 3.10, and 4 backward-scan warps 3.07. The prefetch
  matters more than a second program: removed.
- 16:52 (bench/results/2026-11-29-grad-warps-1652.json): state_grad and wy_grad at 4 warps instead of 8 (ptxas with
  the aligned pointers launches use: two programs per SM): in --backward-settings GDN 2.81 (8 warps) against 2.55
  (wy_grad at 4: 0.65 -> 0.46 ms, predicted 0.50-0.60) and 2.61 (state_grad at 4: 0.70 -> 0.55, predicted no
  faster); both at 4 in two interleaved rounds (bench/grad_warps_rounds.py) GDN 2.43 / 2.40 against 2.69 / 2.66, KDA 4.82 / 4.78 against
  5.02 / 5.07; precision vs fp64 passes for both kinds. Adopted (backward.STATE_GRAD_WARPS, WY_GRAD_WARPS); that
  lease's headline row (8 warps): GDN 2.71 against 165.1 = 60.8x.
- 18:10 (bench/results/2026-11-29-gdn.json, kda.json; the 16:29 files renamed -1629): the first headline run with
  both at 4 warps: GDN 2.36 ms against 206.4 = 87.4x (forward 0.87, fla 0.91; state_grad 0.56, wy_grad 0.46 ms), KDA
  4.91 against 1323.0 = 269.2x; precision vs fp64 <= 3.0e-3 rel RMS for both.
- 18:34 (bench/results/2026-11-29-gdn-fwd-scan-v64-1834.json): the forward scan in 64-wide value blocks as fla
  0.6.0's state kernel runs it (64 programs; its state kernel takes 0.157 ms here): scan 0.365 -> 0.426 ms at 4
  warps (226 registers, no spills) and 0.530 at 8; forward 1.017 -> 1.091 / 1.210 ms in the variant rounds. Removed
  (commit a33483b holds it). fla's state update written with the decayed state as the product's accumulator
  compiles to the same PTX as ours (ptxas offline): not the difference either. That run's headline: GDN 2.364
  against 212.5 = 89.9x, forward 0.937 against fla 1.485.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import statistics
import time
import traceback

import torch
import torch.nn.functional as F

import runtime.kernels.gated_delta as kernels
from runtime.kernels.gated_delta import backward
from runtime.kernels.gated_delta import function as kernel_defaults
import runtime.ops.gated_delta as chunked
from runtime.tolerances import compare, tolerance_for

COMMAND = ("python3 bench/bench_gated_delta.py --out $OUT  (wheels fla-core 0.6.0, einops 0.8.2, transformers 5.24.0 "
           "installed with --target /tmp/site and put on PYTHONPATH with the repository root)")


def make_inputs(kind: str, num_tokens: int, num_heads: int, dim: int, seed: int = 0) -> dict:
    """bf16 inputs on the GPU; decays as the models make them (log-sigmoid of a projection)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (1, num_tokens, num_heads, dim)
    rand = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    g_shape = shape if kind == "kda" else shape[:3]
    return {
        "q": rand(*shape).bfloat16(), "k": rand(*shape).bfloat16(), "v": rand(*shape).bfloat16(),
        "g": F.logsigmoid(rand(*g_shape) + 2.0).bfloat16(), "beta": torch.sigmoid(rand(*shape[:3])).bfloat16(),
        "do": rand(*shape).bfloat16(),
    }


def ours(kind: str, variant: str = "default"):
    op = kernels.kda if kind == "kda" else kernels.gated_delta_rule
    return lambda q, k, v, g, beta: op(q, k, v, g, beta, use_qk_l2norm=True, variant=variant)[0]


def transformers_torch(kind: str):
    """transformers' torch chunked path; __wrapped__ skips the fla/hub kernel it may have been swapped for."""
    if kind == "kda":
        from transformers.models.kimi_linear import modeling_kimi_linear as module
        fn = module.chunk_kimi_delta_attention
    else:
        from transformers.models.qwen3_next import modeling_qwen3_next as module
        fn = module.torch_chunk_gated_delta_rule
    fn = getattr(fn, "__wrapped__", fn)
    return lambda q, k, v, g, beta: fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]


def fla_forward(kind: str):
    if kind == "kda":
        from fla.ops.kda import chunk_kda as fn
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    return lambda q, k, v, g, beta: fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]


def time_ms(step, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_forward(fn, x: dict, warmup=3, reps=10) -> float:
    with torch.no_grad():
        return time_ms(lambda: fn(x["q"], x["k"], x["v"], x["g"], x["beta"]), warmup, reps)


def time_forward_backward(fn, x: dict, warmup=3, reps=10) -> tuple[float, float]:
    """(median ms, peak GiB) of forward + backward into q, k, v, g, beta."""
    leaves = [x[n].detach().requires_grad_() for n in ("q", "k", "v", "g", "beta")]

    def step():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(x["do"])

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = time_ms(step, warmup, reps)
    return ms, torch.cuda.max_memory_allocated() / 2**30


def training_step(fn, x: dict, backward: bool):
    """One forward (with backward: and backward into q, k, v, g, beta) of fn, as a closure; the leaves' grads are
    reset first, else a profile or a timing holds their accumulation, which no training step has here."""
    leaves = [x[n].detach().requires_grad_(backward) for n in ("q", "k", "v", "g", "beta")]

    def step():
        for t in leaves:
            t.grad = None
        with torch.set_grad_enabled(backward):
            o = fn(*leaves)
            if backward:
                o.backward(x["do"])

    return step


def host_issue_ms(fn, x: dict, backward: bool, reps: int = 10) -> float:
    """Host milliseconds to issue one forward (or forward+backward) without waiting for the GPU: where it
    exceeds the step's GPU time, wall time follows the host (launch-bound), not the kernels."""
    step = training_step(fn, x, backward)
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued / reps * 1000


def outputs_and_grads(fn, x: dict, dtype=None) -> list[torch.Tensor]:
    """[o, dq, dk, dv, dg, dbeta] of fn, optionally with the inputs cast to dtype first."""
    leaves = [(x[n] if dtype is None else x[n].to(dtype)).detach().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    o = fn(*leaves)
    o.backward(x["do"].to(o.dtype))
    return [o.detach()] + [t.grad for t in leaves]


def reference(kind: str, x: dict, heads_per_group: int = 8) -> list[torch.Tensor]:
    """fp64 [o, dq, dk, dv, dg, dbeta], a few heads at a time (heads are independent) to bound memory."""
    op = chunked.kda if kind == "kda" else chunked.gated_delta_rule
    fn = lambda q, k, v, g, beta: op(q, k, v, g, beta, use_qk_l2norm=True)[0]
    parts = []
    for h0 in range(0, x["q"].shape[2], heads_per_group):
        sl = {n: t[:, :, h0 : h0 + heads_per_group] for n, t in x.items()}
        parts.append(outputs_and_grads(fn, sl, torch.float64))
    return [torch.cat(group, dim=2) for group in zip(*parts)]


NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def errors(kind: str, got: list, ref: list) -> dict:
    op = "kda" if kind == "kda" else "gated_delta_rule"
    result = {}
    for name, a, e in zip(NAMES, got, ref):
        c = compare(a, e, tolerance_for(op, torch.bfloat16, "out" if name == "o" else "grad"))
        result[name] = {"rel_rms": c.rel_rms, "max_abs_rel": c.max_abs_rel, "passed": c.passed}
    return result


def run_kind(kind: str, x: dict, report: dict, variants: list[str], save, deadline: float,
             backward_settings: list[str] = ()) -> None:
    """Our timings first, then precision, then the baselines, then the variants (none starts after
    deadline, a time.monotonic() value): a run cut short keeps what matters most."""
    r = report.setdefault(kind, {})
    ref = Lazy(lambda: reference(kind, x))
    steps = [
        ("ours_fwd_ms", lambda: time_forward(ours(kind), x)),
        ("ours_fwdbwd", lambda: time_forward_backward(ours(kind), x)),
        ("breakdown_ms", lambda: breakdown(kind, x)),
        ("precision", lambda: errors(kind, outputs_and_grads(ours(kind), x), ref.get())),
        ("baseline_fwd_ms", lambda: time_forward(transformers_torch(kind), x, 1, 3 if kind == "kda" else 10)),
        ("baseline_fwdbwd", lambda: time_forward_backward(transformers_torch(kind), x, 1, 3 if kind == "kda" else 10)),
        ("fla_fwd_ms", lambda: time_forward(fla_forward(kind), x)),
        ("fla_fwd_kernels_ms", lambda: kernel_profile(fla_forward(kind), x)),
        ("ours_fwd_kernels_ms", lambda: kernel_profile(ours(kind), x)),
        ("host_issue_ms", lambda: {"ours_fwd": host_issue_ms(ours(kind), x, False),
                                   "ours_fwdbwd": host_issue_ms(ours(kind), x, True),
                                   "fla_fwd": host_issue_ms(fla_forward(kind), x, False)}),
    ]
    steps += [(f"variant_{name}", lambda name=name: run_variant(kind, x, name, ref.get(), deadline))
              for name in variants]
    steps += [(f"bwd_settings_{name}", lambda name=name: run_backward_settings(kind, x, name, ref.get(), deadline))
              for name in backward_settings]
    for key, compute in steps:
        section(r, key, compute)
        torch.cuda.empty_cache()
        save()


def kernel_profile(fn, x: dict, backward: bool = False, reps: int = 5) -> dict:
    """GPU milliseconds per step of each kernel a forward (or forward+backward) of fn launches, from
    torch.profiler: where a baseline or a variant spends its time, whatever its kernels are called."""
    step = training_step(fn, x, backward)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us > 0:
            times[event.key[:80]] = round(us / reps / 1000, 4)
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:15])


class Lazy:
    """A value computed on first use: the fp64 reference is shared by every precision check."""

    def __init__(self, compute):
        self.compute, self.value = compute, None

    def get(self):
        if self.value is None:
            self.value = self.compute()
        return self.value


def breakdown(kind: str, x: dict, name: str = "default") -> dict:
    """GPU milliseconds of each of our kernels in one forward+backward of a variant."""
    return kernel_profile(ours(kind, name), x, backward=True)


def run_variant(kind: str, x: dict, name: str, ref: list, deadline: float) -> dict | str:
    """Precision first (a wrong variant's time means nothing), then fwd, fwd+bwd and the breakdown."""
    if time.monotonic() > deadline:
        return "skipped: --budget-s spent"
    precision = errors(kind, outputs_and_grads(ours(kind, name), x), ref)
    fwd = time_forward(ours(kind, name), x)
    fwdbwd, peak = time_forward_backward(ours(kind, name), x)
    return {"fwd_ms": fwd, "fwdbwd_ms": fwdbwd, "peak_mem_gib": peak, "breakdown_ms": breakdown(kind, x, name),
            "all_passed": all(e["passed"] for e in precision.values()), "precision_vs_fp64": precision,
            "settings": dataclasses.asdict(kernels.VARIANTS[name]) if name in kernels.VARIANTS else
            dataclasses.asdict(kernel_defaults.default_variant(kind == "kda", torch.bfloat16))}


def run_backward_settings(kind: str, x: dict, name: str, ref: list, deadline: float) -> dict | str:
    """The default variant with the backward kernels' launch constants set to backward.SETTINGS[name]."""
    if time.monotonic() > deadline:
        return "skipped: --budget-s spent"
    backward.use_settings(name)
    try:
        precision = errors(kind, outputs_and_grads(ours(kind), x), ref)
        fwdbwd, peak = time_forward_backward(ours(kind), x)
        return {"fwdbwd_ms": fwdbwd, "peak_mem_gib": peak, "breakdown_ms": breakdown(kind, x),
                "all_passed": all(e["passed"] for e in precision.values()), "precision_vs_fp64": precision,
                "settings": backward.SETTINGS[name]}
    finally:
        backward.use_settings("default")


def section(r: dict, key: str, compute) -> None:
    """One measurement; a failure is recorded and printed, the rest still runs."""
    try:
        r[key] = compute()
    except Exception as exc:  # a missing baseline must not hide our numbers
        traceback.print_exc()
        r[key] = f"error: {type(exc).__name__}: {exc}"[:500]
    print(f"  {key}: {r[key]}", flush=True)


def results_file(kind: str, r: dict, shape: str, device: str) -> dict:
    fwdbwd = r.get("ours_fwdbwd")
    base = r.get("baseline_fwdbwd")
    ok = isinstance(fwdbwd, tuple | list) and isinstance(base, tuple | list)
    prec = r.get("precision") if isinstance(r.get("precision"), dict) else {}
    baseline_name = ("transformers 5.24 chunk_kimi_delta_attention (torch path, qk l2norm)" if kind == "kda"
                     else "transformers 5.24 torch_chunk_gated_delta_rule (torch path, qk l2norm)")
    return {
        "name": kind, "device": device, "shape": shape, "baseline": baseline_name + ", forward+backward",
        "baseline_ms": base[0] if ok else None, "ours_ms": fwdbwd[0] if ok else None,
        "speedup": base[0] / fwdbwd[0] if ok else None,
        "max_rel_err": max((v["rel_rms"] for v in prec.values()), default=None),
        "command": COMMAND, "date": datetime.date.today().isoformat(),
        "forward": {"ours_ms": r.get("ours_fwd_ms"), "baseline_ms": r.get("baseline_fwd_ms"),
                    "fla_0.6.0_ms": r.get("fla_fwd_ms")},
        "breakdown_ms": r.get("breakdown_ms"),
        "peak_mem_gib": fwdbwd[1] if ok else None, "baseline_peak_mem_gib": base[1] if ok else None,
        "precision_vs_fp64": prec,
        "variants": {k: v for k, v in r.items() if k.startswith("variant_")},
    }


def variants_file(report: dict, shape: str, device: str) -> dict:
    """Every variant of every kind side by side with the default and the baselines of the same run."""
    result = {"device": device, "shape": shape, "date": datetime.date.today().isoformat(),
              "command": COMMAND.replace("--out $OUT", "--out $OUT --variants")}
    for kind, r in report.items():
        base = r.get("baseline_fwdbwd")
        base_ms = base[0] if isinstance(base, tuple | list) else None
        rows = {k.removeprefix("variant_").replace("bwd_settings_", "bwd:"): v for k, v in r.items()
                if k.startswith(("variant_", "bwd_settings_"))}
        default_ms = (rows.get("default") or {}).get("fwdbwd_ms") if isinstance(rows.get("default"), dict) else None
        for row in rows.values():
            if isinstance(row, dict):
                row["speedup_vs_default"] = default_ms / row["fwdbwd_ms"] if default_ms else None
                row["speedup_vs_baseline"] = base_ms / row["fwdbwd_ms"] if base_ms else None
        result[kind] = {"baseline_fwdbwd_ms": base_ms, "baseline_fwd_ms": r.get("baseline_fwd_ms"),
                        "fla_0.6.0_fwd_ms": r.get("fla_fwd_ms"), "variants": rows}
    return result


def print_variants(report: dict) -> None:
    print(f"\n{'op':5} {'variant':24} {'fwd ms':>8} {'fwd+bwd ms':>11} {'x default':>10} {'x baseline':>11} "
          f"{'peak GiB':>9} precision")
    for kind, r in report.items():
        for key, row in r.items():
            if not key.startswith(("variant_", "bwd_settings_")):
                continue
            name = key.removeprefix("variant_").replace("bwd_settings_", "bwd:")
            if not isinstance(row, dict):
                print(f"{kind:5} {name:24} {str(row)[:70]}")
                continue
            ratio = lambda v: f"{v:.2f}" if v else "-"
            fwd = f"{row['fwd_ms']:8.3f}" if "fwd_ms" in row else "       -"
            print(f"{kind:5} {name:24} {fwd} {row['fwdbwd_ms']:11.3f} "
                  f"{ratio(row.get('speedup_vs_default')):>10} {ratio(row.get('speedup_vs_baseline')):>11} "
                  f"{row['peak_mem_gib']:9.2f} {'ok' if row['all_passed'] else 'FAIL'}")


def print_table(report: dict) -> None:
    print(f"\n{'op':5} {'what':12} {'ours ms':>9} {'baseline ms':>12} {'speedup':>8} {'fla fwd ms':>10}")
    for kind, r in report.items():
        fb, base = r.get("ours_fwdbwd"), r.get("baseline_fwdbwd")
        rows = [("fwd", r.get("ours_fwd_ms"), r.get("baseline_fwd_ms")),
                ("fwd+bwd", fb[0] if isinstance(fb, tuple | list) else fb, base[0] if isinstance(base, tuple | list) else base)]
        for what, a, b in rows:
            speed = f"{b / a:8.1f}" if isinstance(a, float) and isinstance(b, float) else "       -"
            fla = r.get("fla_fwd_ms") if what == "fwd" else ""
            fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)[:20]
            print(f"{kind:5} {what:12} {fmt(a):>9} {fmt(b):>12} {speed} {fmt(fla):>10}")
        for name, e in (r.get("precision") or {}).items() if isinstance(r.get("precision"), dict) else []:
            print(f"      {name:6} rel_rms {e['rel_rms']:.2e} max_abs_rel {e['max_abs_rel']:.2e} {'ok' if e['passed'] else 'FAIL'}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--kinds", default="gdn,kda")
    # default first (timed again beside the others), then in VARIANTS' order (most promising first)
    order = ["default"] + list(kernels.VARIANTS)
    parser.add_argument("--variants", nargs="?", const=",".join(order), default="",
                        help="comma-separated names of runtime.kernels.gated_delta.VARIANTS (all when bare)")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="seconds from the start after which no further variant starts (split across kinds)")
    parser.add_argument("--backward-settings", nargs="?", default="",
                        const=",".join(name for name in backward.SETTINGS if name != "default"),
                        help="comma-separated names of gated_delta.backward.SETTINGS (all when bare), timed after the variants")
    args = parser.parse_args()
    variants = [name for name in args.variants.split(",") if name]
    backward_settings = [name for name in args.backward_settings.split(",") if name]
    if set(backward_settings) - set(backward.SETTINGS):
        parser.error(f"--backward-settings: unknown {sorted(set(backward_settings) - set(backward.SETTINGS))}")
    unknown = set(variants) - set(kernels.VARIANTS) - {"default"}
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; known: {sorted(kernels.VARIANTS)}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    shape = f"B1 T{args.seq_len} H{args.heads} K=V={args.dim} bf16"
    report = {}
    kinds, start = args.kinds.split(","), time.monotonic()
    for i, kind in enumerate(kinds):
        print(f"{kind}: {shape} on {device}", flush=True)

        def save(kind=kind):
            (out / f"{kind}.json").write_text(json.dumps(results_file(kind, report[kind], shape, device), indent=2))
            (out / "raw.json").write_text(json.dumps(report, indent=2, default=str))
            if variants:
                (out / "variants.json").write_text(json.dumps(variants_file(report, shape, device), indent=2))

        deadline = start + args.budget_s * (i + 1) / len(kinds)
        run_kind(kind, make_inputs(kind, args.seq_len, args.heads, args.dim), report, variants, save, deadline,
                 backward_settings)
    print_table(report)
    print_variants(report)


if __name__ == "__main__":
    main()
