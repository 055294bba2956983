"""GDN and KDA fwd+bwd with the gradient kernels' launch constants of backward.SETTINGS, timed in interleaved rounds,
then the fp64 precision check of the default at the benchmark shape (B1 T8192 H32 K=V=128 bf16).

    python3 bench/grad_warps_rounds.py --out DIR

Writes DIR/grad_warps_rounds.json. Run 2026-11-29 16:52-16:53 on the H200 as inline scripts with the same steps
(bench/results/2026-11-29-grad-warps-1652.json), when the default was 8 warps and 4 warps were named wy_state_w4 /
wy_w4 / state_w4: what they are now default / state_w8 / wy_w8 against w8.
"""
import argparse
import json
import pathlib

import torch

from bench.bench_gated_delta import errors, make_inputs, ours, outputs_and_grads, reference, time_forward_backward
from runtime.kernels.gated_delta import backward

SETTINGS = {"gdn": ("w8", "default", "state_w8", "wy_w8"), "kda": ("w8", "default", "wy_w8")}


def rounds(kind: str, names: tuple, count: int = 2) -> dict:
    x = make_inputs(kind, 8192, 32, 128)
    ms = {}
    for _ in range(count):
        for name in names:
            backward.use_settings(name)
            ms.setdefault(name, []).append(time_forward_backward(ours(kind), x)[0])
    backward.use_settings("default")
    return ms


def precision(kind: str) -> dict:
    x = make_inputs(kind, 8192, 32, 128)
    return errors(kind, outputs_and_grads(ours(kind), x), reference(kind, x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "command": "python3 bench/grad_warps_rounds.py --out $OUT"}
    for kind, names in SETTINGS.items():
        result[kind] = {"fwdbwd_ms_rounds": rounds(kind, names), "precision_vs_fp64": precision(kind)}
        print(kind, json.dumps(result[kind]["fwdbwd_ms_rounds"]), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grad_warps_rounds.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
