"""The one timing loop of the bench scripts: CUDA-event timed calls, median in ms."""
from __future__ import annotations

import statistics

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
