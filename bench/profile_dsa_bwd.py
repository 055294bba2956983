"""One DSA sparse-attention forward and two backwards at the benchmark's widths (H128, K576 / V512, top-k 2048),
for a profiler to attach to; T=8192 by default, so that ncu's replays of a kernel stay short. The backward runs
its three passes per chunk of 2048 tokens (4 launches of each at T=8192, the dkv pass's twice: value and rope
blocks); the forward is one launch.

    ncu --kernel-name regex:"_bwd_scores_kernel|_bwd_dq_kernel|_bwd_dkv_kernel" --launch-skip 20 --launch-count 4 \\
        --section WarpStateStats --section SchedulerStats --section Occupancy --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis python3 bench/profile_dsa_bwd.py [--T 8192]
    ncu --kernel-name regex:"_fwd_kernel" --launch-count 1 --section WarpStateStats --section SchedulerStats \\
        --section Occupancy --section SpeedOfLight --section MemoryWorkloadAnalysis python3 bench/profile_dsa_bwd.py
"""
import argparse

import torch

from bench import bench_dsa as dsa
from runtime.ops.dsa import attention, indexer

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, default=8192)
    T = parser.parse_args().T
    scale = dsa.QK**-0.5
    q, kv, iq, ik, iw = dsa.sparse_inputs(T)
    idx = indexer.indexer_topk(iq, ik, iw, dsa.J**-0.5, dsa.TOPK)
    o, lse = attention.sparse_attention_fwd(q, kv, idx, scale, dsa.V)
    do = torch.randn_like(o)
    for _ in range(2):
        attention.sparse_attention_bwd(q, kv, idx, o, lse, do, scale)
    torch.cuda.synchronize()
