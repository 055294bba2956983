"""Two GDN forward+backward steps at the benchmark shape (B1 T8192 H32 K=V=128 bf16), for a profiler to attach to.

    ncu --kernel-name regex:"scan_kernel|scan_bwd_kernel|state_grad_kernel|wy_grad_kernel" --launch-skip 4 \\
        --launch-count 4 --section WarpStateStats --section SchedulerStats --section Occupancy \\
        --section SpeedOfLight python3 bench/profile_gdn_step.py

What it found is in bench/NOTES.md.
"""
import torch

from bench.bench_gated_delta import make_inputs, ours, training_step

if __name__ == "__main__":
    step = training_step(ours("gdn"), make_inputs("gdn", 8192, 32, 128), True)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
