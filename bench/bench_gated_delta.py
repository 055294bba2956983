"""Benchmark of the fused GDN and KDA Triton kernels against transformers' torch path and fla's forward.

Checks our bf16 kernels against an fp64 reference at the benchmark shape (the chunked torch form of
runtime/ops/gated_delta.py run in fp64, which the CPU tests show equals the token loop of
reference_ops/ to ~1e-15), then times forward and forward+backward with CUDA events (warm-up, median).
Prints a table and writes gdn.json, kda.json and raw.json into --out.

    python3 bench/bench_gated_delta.py --out DIR [--seq-len 8192 --heads 32 --dim 128] [--variants]

Shape legend: B batch, T tokens, H heads, K key dim, V value dim.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import traceback

import torch
import torch.nn.functional as F

import runtime.kernels.gated_delta as kernels
import runtime.kernels.gated_delta.function as kernel_config
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


def ours(kind: str):
    op = kernels.kda if kind == "kda" else kernels.gated_delta_rule
    return lambda q, k, v, g, beta: op(q, k, v, g, beta, use_qk_l2norm=True)[0]


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


def run_kind(kind: str, x: dict, report: dict, variants: bool, save) -> None:
    """Our timings first, then precision, then the baselines: a run cut short keeps what matters most."""
    r = report.setdefault(kind, {})
    steps = [
        ("ours_fwd_ms", lambda: time_forward(ours(kind), x)),
        ("ours_fwdbwd", lambda: time_forward_backward(ours(kind), x)),
        ("breakdown_ms", lambda: breakdown(kind, x)),
        ("precision", lambda: errors(kind, outputs_and_grads(ours(kind), x), reference(kind, x))),
        ("baseline_fwd_ms", lambda: time_forward(transformers_torch(kind), x, 1, 3 if kind == "kda" else 10)),
        ("baseline_fwdbwd", lambda: time_forward_backward(transformers_torch(kind), x, 1, 3 if kind == "kda" else 10)),
        ("fla_fwd_ms", lambda: time_forward(fla_forward(kind), x)),
    ]
    if variants:
        steps += [(f"variant_{p}_bv{b}", lambda p=p, b=b: run_variant(kind, x, p, b)) for p, b in (("tf32", 32), ("tf32x3", 64))]
    for key, compute in steps:
        section(r, key, compute)
        torch.cuda.empty_cache()
        save()
    kernel_config.DOT_PRECISION, kernel_config.VALUE_BLOCK = "tf32", 64


def breakdown(kind: str, x: dict) -> dict:
    """Milliseconds of each launch of our forward and backward (same inputs, default settings)."""
    f = kernel_config
    per_channel = kind == "kda"
    q, k, v, g, beta, do = (x[n].flatten(0, 1).contiguous() for n in ("q", "k", "v", "g", "beta", "do"))
    layout = f.ChunkLayout.batched(1, x["q"].shape[1], f.CHUNK_SIZE, q.device)
    scale = q.shape[-1] ** -0.5
    prep = f._prep(q, k, v, g, beta, layout, scale, per_channel, True, store_tinv=True)
    h, v_new, _ = f._scan(prep, None, layout, per_channel, store_final=True)
    dh, dv_new, _ = f._scan_bwd(prep, do, None, layout, per_channel, False)
    stages = {
        "prep": lambda: f._prep(q, k, v, g, beta, layout, scale, per_channel, True, store_tinv=False),
        "scan": lambda: f._scan(prep, None, layout, per_channel, store_final=True),
        "output": lambda: f._output(prep, h, v_new, layout, q.dtype),
        "prep_with_tinv": lambda: f._prep(q, k, v, g, beta, layout, scale, per_channel, True, store_tinv=True),
        "scan_bwd": lambda: f._scan_bwd(prep, do, None, layout, per_channel, False),
        "grad": lambda: f._input_grads(q, k, v, g, beta, do, prep, h, dh, v_new, dv_new, layout, scale, per_channel, True),
    }
    return {name: time_ms(step, 2, 10) for name, step in stages.items()}


def run_variant(kind: str, x: dict, prec: str, block: int) -> dict:
    kernel_config.DOT_PRECISION, kernel_config.VALUE_BLOCK = prec, block
    fwd = time_forward(ours(kind), x)
    fwdbwd, _ = time_forward_backward(ours(kind), x)
    return {"fwd_ms": fwd, "fwdbwd_ms": fwdbwd}


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
    parser.add_argument("--variants", action="store_true")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    shape = f"B1 T{args.seq_len} H{args.heads} K=V={args.dim} bf16"
    report = {}
    for kind in args.kinds.split(","):
        print(f"{kind}: {shape} on {device}", flush=True)

        def save(kind=kind):
            (out / f"{kind}.json").write_text(json.dumps(results_file(kind, report[kind], shape, device), indent=2))
            (out / "raw.json").write_text(json.dumps(report, indent=2, default=str))

        run_kind(kind, make_inputs(kind, args.seq_len, args.heads, args.dim), report, args.variants, save)
    print_table(report)


if __name__ == "__main__":
    main()
