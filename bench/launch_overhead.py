"""Where a step's wall time goes besides its kernels: host time per Triton launch, and the GPU timeline of
one step (how long the GPU waits for the first kernel, how long it sits idle between kernels).

    python3 bench/launch_overhead.py --out DIR

Writes DIR/launch-overhead.json:
- `triton_launch_us`: host microseconds per launch of a kernel with our kernels' argument count (24
  tensors, 4 ints, 12 constexprs), through JITFunction (kernel[grid](...)) and through the compiled
  kernel's own launcher (what a launch costs without Triton's per-call binding, key and cache lookup).
- `timeline`: for GDN and KDA at B1 T8192 H32 K=V=128 bf16, forward and forward+backward: wall ms
  (CUDA events), GPU busy ms (sum of kernel durations), the GPU's wait for its first kernel and its
  idle gaps between kernels, from one torch.profiler trace; `host_profile_fwdbwd`: cProfile of the host
  issuing 20 forward+backward steps (own time per function).

Shape legend: B batch, T tokens, H heads, K key dim, V value dim.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pstats
import pathlib
import time

import torch
import triton
import triton.language as tl

from bench.bench_gated_delta import make_inputs, ours, training_step, wall


@triton.jit
def _many_args_kernel(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15, p16, p17, p18, p19,
                      p20, p21, p22, p23, n0, n1, n2, scale,
                      A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, D: tl.constexpr, E: tl.constexpr,
                      F: tl.constexpr, G: tl.constexpr, H: tl.constexpr, I: tl.constexpr, J: tl.constexpr,
                      KK: tl.constexpr, LL: tl.constexpr):
    offs = tl.program_id(0) * 16 + tl.arange(0, 16)
    tl.store(p0 + offs, tl.load(p1 + offs) * scale)


def triton_launch_us(reps: int = 2000) -> dict:
    tensors = [torch.zeros(4096, device="cuda") for _ in range(24)]
    constexprs = dict(A=1, B=2, C=64, D=128, E=True, F=False, G="tf32", H=32, I=16, J=4, KK=8, LL=0)
    args = (*tensors, 4096, 32, 7, 0.5)
    grid = (8,)
    compiled = _many_args_kernel[grid](*args, **constexprs, num_warps=4)
    # the compiled launcher indexes all three grid dimensions
    launch = compiled[(*grid, 1, 1)]
    # the compiled launcher takes every parameter in order, constexprs included
    ordered = (*args, *constexprs.values())
    times = {}
    for name, call in (("jit", lambda: _many_args_kernel[grid](*args, **constexprs, num_warps=4)),
                       ("compiled_launcher", lambda: launch(*ordered))):
        call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            call()
        times[name] = (time.perf_counter() - start) / reps * 1e6
        torch.cuda.synchronize()
    return times


def timeline(fn, x: dict, backward: bool) -> dict:
    """GPU busy time, the wait for the first kernel and the gaps between kernels in one step (profiler trace)."""
    step = training_step(fn, x, backward)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("step"):
            step()
        torch.cuda.synchronize()
    events = prof.events()
    start = min(e.time_range.start for e in events if e.name == "step")
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
                     and "Memset" not in e.name)
    gaps = [b[0] - a[1] for a, b in zip(kernels, kernels[1:])]
    return {"first_kernel_wait_ms": (kernels[0][0] - start) / 1000,
            "busy_ms": sum(e - s for s, e, _ in kernels) / 1000,
            "gaps_ms": sum(max(g, 0) for g in gaps) / 1000,
            "largest_gaps_ms": sorted((round(g / 1000, 4), kernels[i + 1][2][:40]) for i, g in enumerate(gaps))[-4:],
            "span_ms": (kernels[-1][1] - kernels[0][0]) / 1000, "kernels": len(kernels)}


def host_profile(fn, x: dict, backward: bool, reps: int = 20, top: int = 25) -> list[str]:
    """cProfile of the host issuing `reps` steps without waiting for the GPU: the functions with the most
    own time, as pstats lines (where a step's host time goes when it exceeds the GPU's)."""
    step = training_step(fn, x, backward)
    step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"name": "launch-overhead", "device": torch.cuda.get_device_name(), "triton": triton.__version__,
              "date": datetime.date.today().isoformat(), "command": "python3 bench/launch_overhead.py --out $OUT",
              "triton_launch_us": triton_launch_us()}
    print(result, flush=True)
    for kind in ("gdn", "kda"):
        x = make_inputs(kind, 8192, 32, 128)
        result[kind] = {
            "fwd_wall_ms": wall(ours(kind), x, False)["ms"], "fwdbwd_wall_ms": wall(ours(kind), x, True)["ms"],
            "fwd": timeline(ours(kind), x, False), "fwdbwd": timeline(ours(kind), x, True),
            "host_profile_fwdbwd": host_profile(ours(kind), x, True)}
        print(kind, json.dumps(result[kind]), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch-overhead.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
