"""Two GDN forward+backward steps at the benchmark shape (B1 T8192 H32 K=V=128 bf16), for a profiler to attach to.

    ncu --kernel-name regex:"scan_kernel|scan_bwd_kernel|state_grad_kernel|wy_grad_kernel" --launch-skip 4 \\
        --launch-count 4 --section WarpStateStats --section SchedulerStats --section Occupancy \\
        --section SpeedOfLight python3 bench/profile_gdn_step.py

Run 2026-11-29 16:35 on the H200 (the 16:24 defaults; bench/results/2026-11-29-gdn-ncu.txt): the forward scan runs
one 4-warp program per SM (shared memory allows one: 6.25% occupancy), no warp eligible in 86% of cycles, 42% of
the stall cycles waiting on L1TEX (global) loads; scan_bwd one 8-warp program per SM, 79% without an eligible warp;
state_grad two 8-warp programs per SM, L1/TEX at 77% of its throughput; wy_grad one per SM (registers and shared
memory). So the scans want a second program per SM (less shared memory per program) before anything else.
"""
import torch

from bench.bench_gated_delta import make_inputs, ours, training_step

if __name__ == "__main__":
    step = training_step(ours("gdn"), make_inputs("gdn", 8192, 32, 128), True)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
