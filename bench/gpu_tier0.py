"""Alignment tier 0 on a CUDA machine: every op of a few tiny releases, with the fused kernels run on the GPU
in fp32 and bf16 (the CPU suite can run them only under the Triton interpreter, in fp32).

    python bench/gpu_tier0.py --out DIR [--families qwen3_next kimi_linear deepseek_v32]
Writes DIR/gpu-tier0.json: per family the number of checks, failures, and every kernel check.
"""
from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

import torch

from onboard.align.tiers.tier0_ops import tier0
from onboard.examples.models import write_example_model
from onboard.recognize.recognizer import recognize
from onboard.release.manifest import read_manifest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--families", nargs="+", default=["qwen3_next", "kimi_linear", "deepseek_v32"])
    args = parser.parse_args()
    results = {"name": "gpu-tier0", "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "command": "python bench/gpu_tier0.py --out $OUT", "date": datetime.date.today().isoformat(), "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            start = time.time()
            spec = json.loads(recognize(read_manifest(write_example_model(family, Path(tmp) / family))).model_dump_json())
            checks = tier0(spec)
            kernel = [c.model_dump() for c in checks if "/kernel" in c.name]
            failed = [c.name for c in checks if c.verdict == "fail"]
            results["families"][family] = {"checks": len(checks), "failed": failed, "kernel_checks": kernel,
                                           "seconds": round(time.time() - start, 1)}
            print(f"{family}: {len(checks)} checks, {len(failed)} failed, {len(kernel)} kernel checks, "
                  f"{time.time() - start:.0f} s", flush=True)
            for name in failed[:10]:
                print("  FAIL", name, flush=True)
            # after every family: a run stopped by its time limit keeps what it checked
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "gpu-tier0.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
