"""Time read_manifest (and recognize, when present) on the flagship index: 157k tensors, 16 MB.

    python bench/bench_manifest.py [MODEL_DIR] [--repeat 3]

MODEL_DIR defaults to ../shared/examples/seed-2.8t beside the repository.

Prints a table and writes bench/results/manifest.json (the latest result;
earlier ones are in git history). The baseline is a bare json.load
of the index: the floor any reader pays before validating or building anything.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

from onboard.release.manifest import INDEX_NAME, read_manifest

REPO = Path(__file__).resolve().parents[1]
SEED_DIR = REPO.parent / "shared" / "examples" / "seed-2.8t"


def best_ms(fn, repeat: int) -> tuple[float, float, object]:
    """Best wall and best CPU time of `repeat` calls in ms, and the last result.

    CPU time is reported too because the 2-core dev machine is shared: wall time there
    includes waiting for a core.
    """
    wall, cpu, result = float("inf"), float("inf"), None
    for _ in range(repeat):
        # drop the previous result first: a live 157k-entry manifest slows the next one's GC
        result = None
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall = min(wall, time.perf_counter() - start_wall)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall * 1e3, cpu * 1e3, result


def find_recognize():
    try:
        return getattr(importlib.import_module("onboard.recognize.recognizer"), "recognize", None)
    except ImportError:
        return None


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, nargs="?", default=SEED_DIR, help=f"default {SEED_DIR}")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if not (args.model_dir / INDEX_NAME).is_file():
        parser.error(f"{args.model_dir / INDEX_NAME} does not exist; pass the folder of a release with a weight index")

    index_path = args.model_dir / INDEX_NAME
    json_ms, json_cpu, _ = best_ms(lambda: json.loads(index_path.read_bytes()), args.repeat)
    read_ms, read_cpu, manifest = best_ms(lambda: read_manifest(args.model_dir), args.repeat)
    rows = [("json.load of the index (baseline)", json_ms, json_cpu), ("read_manifest", read_ms, read_cpu)]
    recognize = find_recognize()
    recognize_ms = recognize_cpu = None
    if recognize is not None:
        recognize_ms, recognize_cpu, _ = best_ms(lambda: recognize(manifest), args.repeat)
        rows.append(("recognize(manifest)", recognize_ms, recognize_cpu))

    print(f"{args.model_dir}: {manifest.num_tensors} tensors, {len(manifest.shard_files)} shards, "
          f"{manifest.total_params / 1e12:.3f}T params, best of {args.repeat}")
    print(f"{'step':<36}{'wall ms':>10}{'cpu ms':>10}")
    for name, wall, cpu in rows:
        print(f"{name:<36}{wall:>10.1f}{cpu:>10.1f}")

    date = datetime.date.today().isoformat()
    result = {
        "name": "manifest",
        "device": f"CPU: {cpu_name()}",
        "shape": f"{manifest.num_tensors} tensors, index {index_path.stat().st_size} bytes, shards absent",
        "baseline": "json.load of model.safetensors.index.json alone (no validation, no objects)",
        "baseline_ms": round(json_ms, 2),
        "ours_ms": round(read_ms, 2),
        "speedup": round(json_ms / read_ms, 3),
        "max_rel_err": None,
        "ours_cpu_ms": round(read_cpu, 2),
        "baseline_cpu_ms": round(json_cpu, 2),
        "recognize_ms": None if recognize_ms is None else round(recognize_ms, 2),
        "recognize_cpu_ms": None if recognize_cpu is None else round(recognize_cpu, 2),
        "repeat": args.repeat,
        "command": "python " + " ".join(sys.argv),
        "date": date,
    }
    out = REPO / "bench" / "results" / "manifest.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
