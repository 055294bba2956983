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
