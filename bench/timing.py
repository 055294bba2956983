"""The timing loops of the bench scripts: CUDA-event timed calls, median in ms; the profiler's kernel times; CUDA-graph
replays in steady state."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def time_ms(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median GPU-event time of fn() in ms over `reps` calls after `warmup` untimed ones."""
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


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30


def kernel_ms(step, reps: int = 3, warmup: int = 2) -> dict[str, float]:
    """GPU ms per call of step() for each kernel name (torch.profiler, kernels and copies only): host time
    and launch gaps excluded, whatever the kernels are called."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0:
            per_kernel[event.key] = per_kernel.get(event.key, 0.0) + event.self_device_time_total / reps / 1e3
    return per_kernel


def captured(step, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """step() captured as a CUDA graph, after `warmup` eager calls on a side stream (compiles, workspaces)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def settle(fn: Callable, seconds: float, calls_per_sync: int = 8) -> None:
    """fn() back to back for `seconds`, untimed, so that what is timed next runs at the GPU's sustained clocks: kernels
    that keep HBM and the tensor cores busy together run into the power cap and slow, settling within about a second
    (`git show 99a26d7:bench/NOTES.md`). A sync every few calls keeps the host from queueing more GPU time than
    `seconds`."""
    settled_at = time.perf_counter() + seconds
    while time.perf_counter() < settled_at:
        for _ in range(calls_per_sync):
            fn()
        torch.cuda.synchronize()


def steady_graph_ms(steps: dict[str, Callable], settle_s: float = 1.0, reps: int = 50,
                    rounds: int = 5) -> dict[str, float]:
    """Median ms per replay of each step captured as a CUDA graph and replayed back to back, as a trainer runs it: in
    each of `rounds` rounds (the steps in turn) `settle_s` seconds of untimed replays bring the GPU to that step's
    sustained clocks (settle), then `reps` replays are timed with events. A short profile sees kernels at the clocks
    of an idle GPU."""
    graphs = {name: captured(step) for name, step in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, graph in graphs.items():
            settle(graph.replay, settle_s)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / reps)
    return {name: statistics.median(t) for name, t in times.items()}
