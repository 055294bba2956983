"""Two GDN or KDA forward+backward steps at the benchmark shape (B1 T8192 H32 K=V=128 bf16), for a profiler to
attach to.

    ncu --kernel-name regex:"scan_kernel|scan_bwd_kernel|state_grad_kernel|wy_grad_kernel" --launch-skip 4 \\
        --launch-count 4 --section WarpStateStats --section SchedulerStats --section Occupancy \\
        --section SpeedOfLight python3 bench/profile_gdn_step.py
    ncu --kernel-name regex:"prep_blocked_kernel|diag_token_kernel" --launch-skip 2 \\
        --launch-count 2 --section WarpStateStats --section SchedulerStats --section Occupancy \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis python3 bench/profile_gdn_step.py --kind kda

(KDA's forward runs diag_token and prep_blocked once a step: skip the first step's two.) What it
found is in `git show 99a26d7:bench/NOTES.md`.
"""
import argparse

import torch

from bench.bench_gated_delta import make_inputs, ours, training_step

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=("gdn", "kda"), default="gdn")
    kind = parser.parse_args().kind
    step = training_step(ours(kind), make_inputs(kind, 8192, 32, 128), True)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
