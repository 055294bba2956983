"""Benchmark of the fused GDN and KDA Triton kernels against transformers' torch path and fla 0.6.0.

For each kind: our bf16 kernels' precision against an fp64 reference at the benchmark shape (the chunked
torch form of runtime/ops, run in fp64), then forward and forward+backward wall time (bench/timing.py),
GPU kernel time from torch.profiler and peak memory, for ours, transformers' torch path and fla, and ours and
fla's steps as CUDA graphs replayed back to back at sustained clocks ("sustained"). Prints a table and writes
gdn.json and kda.json (the fields of shared/TARGETS.md) into --out.

    python3 bench/bench_gated_delta.py --out $OUT [--seq-len 8192 --heads 32 --dim 128 --kinds gdn,kda]

fla 0.6.0 refuses its gated backward on Hopper with triton < 3.7.1 (a miscompile it saw there); the
benchmark lifts that guard to time fla as a baseline only, as shared/TARGETS.md describes.
Every measurement is its own section: a failing baseline is recorded as an error and the rest still runs.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import traceback

import torch
import torch.nn.functional as F

import runtime.ops.gated_delta.kernel as kernels
import runtime.ops.gated_delta.torch_form as chunked_gdn
import runtime.ops.gated_delta.kda_torch_form as chunked_kda
from bench.timing import kernel_ms, peak_gib, steady_graph_ms, time_ms
from runtime.tolerances import compare, tolerance_for

WHEELS = ("(wheels fla-core 0.6.0, einops 0.8.2, transformers 5.24.0 installed with --target /tmp/site and put on "
          "PYTHONPATH with the repository root)")
OPS = {"gdn": "gated_delta_rule", "kda": "kda"}
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def make_inputs(kind: str, num_tokens: int, num_heads: int, dim: int, seed: int = 0) -> dict:
    """bf16 inputs on the GPU; decays as the models make them (log-sigmoid of a projection)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (1, num_tokens, num_heads, dim)
    rand = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
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


def fla(kind: str):
    import fla.ops.common.chunk_o as chunk_o

    # the Hopper guard of fla's gated backward (see the module docstring): lifted to time the baseline
    chunk_o.TRITON_ABOVE_3_7_1 = True
    if kind == "kda":
        from fla.ops.kda import chunk_kda as fn
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    return lambda q, k, v, g, beta: fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]


def training_step(fn, x: dict, backward: bool):
    """One forward (with backward: and backward into q, k, v, g, beta) of fn, as a closure; the leaves' grads are
    reset first, else a timing holds their accumulation, which no training step has here."""
    leaves = [x[n].detach().requires_grad_(backward) for n in ("q", "k", "v", "g", "beta")]

    def step():
        for t in leaves:
            t.grad = None
        with torch.set_grad_enabled(backward):
            o = fn(*leaves)
            if backward:
                o.backward(x["do"])

    return step


def wall(fn, x: dict, backward: bool, reps: int = 10, warmup: int = 3) -> dict:
    """Median wall ms (CUDA events) of a forward or forward+backward step, and its peak GiB."""
    step = training_step(fn, x, backward)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return {"ms": time_ms(step, reps, warmup), "peak_gib": peak_gib()}


def kernel_profile(fn, x: dict, backward: bool, reps: int = 5) -> dict:
    """GPU ms per step: the sum over every kernel the step launches ("total") and the 15 largest, from
    torch.profiler, whatever the kernels are called."""
    times = {}
    for name, ms in kernel_ms(training_step(fn, x, backward), reps=reps).items():
        times[name[:80]] = times.get(name[:80], 0.0) + ms
    largest = dict(sorted(times.items(), key=lambda kv: -kv[1])[:15])
    return {"total": sum(times.values()), "kernels": {k: round(v, 4) for k, v in largest.items()}}


def outputs_and_grads(fn, x: dict, dtype=None) -> list[torch.Tensor]:
    """[o, dq, dk, dv, dg, dbeta] of fn, optionally with the inputs cast to dtype first."""
    leaves = [(x[n] if dtype is None else x[n].to(dtype)).detach().requires_grad_()
              for n in ("q", "k", "v", "g", "beta")]
    o = fn(*leaves)
    o.backward(x["do"].to(o.dtype))
    return [o.detach()] + [t.grad for t in leaves]


def reference(kind: str, x: dict, heads_per_group: int = 8) -> list[torch.Tensor]:
    """fp64 [o, dq, dk, dv, dg, dbeta], a few heads at a time (heads are independent) to bound memory."""
    op = chunked_kda.kda if kind == "kda" else chunked_gdn.gated_delta_rule
    fn = lambda q, k, v, g, beta: op(q, k, v, g, beta, use_qk_l2norm=True)[0]  # noqa: E731
    parts = []
    for h0 in range(0, x["q"].shape[2], heads_per_group):
        sl = {n: t[:, :, h0 : h0 + heads_per_group] for n, t in x.items()}
        parts.append(outputs_and_grads(fn, sl, torch.float64))
    return [torch.cat(group, dim=2) for group in zip(*parts)]


def precision(kind: str, x: dict) -> dict:
    """Relative RMS and max-abs errors of our bf16 outputs and gradients against the fp64 reference."""
    got, ref = outputs_and_grads(ours(kind), x), reference(kind, x)
    result = {}
    for name, a, e in zip(NAMES, got, ref):
        c = compare(a, e, tolerance_for(OPS[kind], torch.bfloat16, "out" if name == "o" else "grad"))
        result[name] = {"rel_rms": c.rel_rms, "max_abs_rel": c.max_abs_rel, "passed": c.passed}
    return result


def measurements(kind: str, x: dict) -> list[tuple[str, object]]:
    """(key, zero-argument function) in the order they run: ours first, so a run cut short keeps them, then fla
    (the GPU-time bar's peer), then the torch path, the slowest (KDA's takes over a second a step)."""
    steps = [("precision", lambda: precision(kind, x))]
    for name, make in (("ours", ours), ("fla", fla), ("baseline", transformers_torch)):
        # the torch path takes up to seconds a step: one warm-up, and for KDA three timed steps
        reps, warmup = ((3 if kind == "kda" else 10), 1) if name == "baseline" else (10, 3)
        for backward, what in ((False, "fwd"), (True, "fwdbwd")):
            steps.append((f"{name}_{what}", lambda m=make, b=backward, r=reps, w=warmup: wall(m(kind), x, b, r, w)))
            if name != "baseline":
                steps.append((f"{name}_{what}_gpu", lambda m=make, b=backward: kernel_profile(m(kind), x, b)))
        if name == "fla":
            for backward, what in ((False, "fwd"), (True, "fwdbwd")):
                steps.append((f"graph_{what}", lambda b=backward: sustained(kind, x, b)))
    return steps


def sustained(kind: str, x: dict, backward: bool) -> dict:
    """ms per step of ours and fla's, each captured as a CUDA graph and replayed back to back in interleaved rounds
    after a second of replays (bench.timing.steady_graph_ms): the sustained clocks a trainer's graphed steps see, where
    the profile's kernel time sees the clocks of a GPU idle between eager steps."""
    return steady_graph_ms({"ours": training_step(ours(kind), x, backward),
                            "fla": training_step(fla(kind), x, backward)})


def run_kind(kind: str, x: dict, save) -> dict:
    r = {}
    for key, compute in measurements(kind, x):
        try:
            r[key] = compute()
        except Exception as exc:  # a missing baseline must not hide our numbers
            traceback.print_exc()
            r[key] = f"error: {type(exc).__name__}: {exc}"[:500]
        print(f"  {key}: {r[key]}", flush=True)
        torch.cuda.empty_cache()
        save(r)
    return r


def field(r: dict, key: str, name: str):
    """r[key][name], or None where that measurement failed or did not run."""
    value = r.get(key)
    return value.get(name) if isinstance(value, dict) else None


def results_file(kind: str, r: dict, shape: str, device: str, command: str) -> dict:
    """The JSON of one kind: shared/TARGETS.md's fields, then the details."""
    ours_ms, base_ms = field(r, "ours_fwdbwd", "ms"), field(r, "baseline_fwdbwd", "ms")
    prec = r.get("precision") if isinstance(r.get("precision"), dict) else {}
    baseline_name = ("transformers 5.24 chunk_kimi_delta_attention" if kind == "kda"
                     else "transformers 5.24 torch_chunk_gated_delta_rule")
    return {
        "name": kind, "device": device, "shape": shape,
        "baseline": baseline_name + " (torch path, qk l2norm), forward+backward",
        "baseline_ms": base_ms, "ours_ms": ours_ms,
        "speedup": base_ms / ours_ms if ours_ms and base_ms else None,
        "max_rel_err": max((v["rel_rms"] for v in prec.values()), default=None),
        "command": f"{command}  {WHEELS}", "date": datetime.date.today().isoformat(),
        "fwd_gpu_ms": field(r, "ours_fwd_gpu", "total"), "fla_fwd_gpu_ms": field(r, "fla_fwd_gpu", "total"),
        "fwdbwd_gpu_ms": field(r, "ours_fwdbwd_gpu", "total"),
        "fla_fwdbwd_gpu_ms": field(r, "fla_fwdbwd_gpu", "total"),
        "sustained": {"fwd_graph_ms": field(r, "graph_fwd", "ours"), "fla_fwd_graph_ms": field(r, "graph_fwd", "fla"),
                      "fwdbwd_graph_ms": field(r, "graph_fwdbwd", "ours"),
                      "fla_fwdbwd_graph_ms": field(r, "graph_fwdbwd", "fla")},
        "forward": {"ours_ms": field(r, "ours_fwd", "ms"), "baseline_ms": field(r, "baseline_fwd", "ms"),
                    "fla_0.6.0_ms": field(r, "fla_fwd", "ms")},
        "fla_0.6.0_fwdbwd_ms": field(r, "fla_fwdbwd", "ms"),
        "peak_mem_gib": field(r, "ours_fwdbwd", "peak_gib"),
        "baseline_peak_mem_gib": field(r, "baseline_fwdbwd", "peak_gib"),
        "fla_peak_mem_gib": field(r, "fla_fwdbwd", "peak_gib"),
        "breakdown_ms": field(r, "ours_fwdbwd_gpu", "kernels"),
        "fla_breakdown_ms": field(r, "fla_fwdbwd_gpu", "kernels"),
        "precision_vs_fp64": prec,
        "errors": {k: v for k, v in r.items() if isinstance(v, str)},
    }


def print_table(results: dict) -> None:
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else "-"  # noqa: E731
    print(f"\n{'op':4} {'what':8} {'ours ms':>9} {'torch ms':>10} {'speedup':>8} {'fla ms':>8} {'ours GPU':>9} "
          f"{'fla GPU':>8}")
    for kind, res in results.items():
        fwd = res["forward"]
        rows = [("fwd", fwd["ours_ms"], fwd["baseline_ms"], fwd["fla_0.6.0_ms"], res["fwd_gpu_ms"],
                 res["fla_fwd_gpu_ms"]),
                ("fwd+bwd", res["ours_ms"], res["baseline_ms"], res["fla_0.6.0_fwdbwd_ms"], res["fwdbwd_gpu_ms"],
                 res["fla_fwdbwd_gpu_ms"])]
        for what, a, b, f, ga, gf in rows:
            speed = f"{b / a:8.1f}" if a and b else "       -"
            print(f"{kind:4} {what:8} {fmt(a):>9} {fmt(b):>10} {speed} {fmt(f):>8} {fmt(ga):>9} {fmt(gf):>8}")
        graphs = res["sustained"]
        print(f"     sustained CUDA-graph ms: fwd ours {fmt(graphs['fwd_graph_ms'])} fla "
              f"{fmt(graphs['fla_fwd_graph_ms'])}, fwd+bwd ours {fmt(graphs['fwdbwd_graph_ms'])} fla "
              f"{fmt(graphs['fla_fwdbwd_graph_ms'])}")
        for name, e in res["precision_vs_fp64"].items():
            print(f"     {name:6} rel_rms {e['rel_rms']:.2e} max_abs_rel {e['max_abs_rel']:.2e} "
                  f"{'ok' if e['passed'] else 'FAIL'}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT"), required=os.environ.get("OUT") is None)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--kinds", default="gdn,kda")
    args = parser.parse_args(argv)
    command = " ".join(["python3 bench/bench_gated_delta.py --out $OUT"]
                       + [f"--{name.replace('_', '-')} {value}" for name, value in vars(args).items()
                          if name != "out" and value != parser.get_default(name)])
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    shape = f"B1 T{args.seq_len} H{args.heads} K=V={args.dim} bf16"
    results = {}
    for kind in args.kinds.split(","):
        print(f"{kind}: {shape} on {device}", flush=True)

        def save(r, kind=kind):
            results[kind] = results_file(kind, r, shape, device, command)
            (out / f"{kind}.json").write_text(json.dumps(results[kind], indent=2))

        run_kind(kind, make_inputs(kind, args.seq_len, args.heads, args.dim), save)
    print_table(results)


if __name__ == "__main__":
    main()
