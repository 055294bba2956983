"""On the GPU: torch._grouped_mm's per-expert weight gradient (grouped_wgrad.sorted_rows_wgrad, the MoE default for
the gate/up weights) against grouped_wgrad, with three experts that receive no rows (they must come out zero).

    python3 bench/check_sorted_rows_wgrad.py

Run 2026-11-29 16:03 on the H200 (bench/results/2026-11-29-sorted-rows-wgrad-check.json): the empty experts' largest
|grad| 0.0, rel RMS against grouped_wgrad 0.0 (bf16, T 512, k 4, E 16, D 256, 2F 128).
Shape legend: T tokens, k top-k, E experts, D model width, F expert width, S = T * k sorted rows.
"""
import torch

from runtime.kernels.moe import grouped_wgrad as gw
from runtime.kernels.moe.schedule import build_schedule

if __name__ == "__main__":
    T, k, E, D, F2 = 512, 4, 16, 256, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    # experts E-3 .. E-1 get no rows
    idx = torch.randint(0, E - 3, (T, k), device="cuda", generator=g)
    idx[:, 1:] = (idx[:, :1] + torch.arange(1, k, device="cuda")) % (E - 3)
    sched = build_schedule(idx, E, 128)
    S = T * k
    a = torch.randn(S, F2, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    got = gw.sorted_rows_wgrad(a, b, sched)
    want = gw.grouped_wgrad(a, b, sched)
    ends = sched.ends_E.tolist()
    print("empty experts", [e for e in range(E) if ends[e] == (ends[e - 1] if e else 0)],
          "their max |grad|", got[E - 3:].abs().max().item(),
          "rel RMS vs grouped_wgrad", ((got.float() - want.float()).pow(2).mean() / want.float().pow(2).mean()).sqrt().item())
