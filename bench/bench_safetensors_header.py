"""Time read_header on one safetensors file whose header lists many entries (the reader's per-entry cost).

    python bench/bench_safetensors_header.py [--entries 20000] [--repeat 5]

Prints the best wall and CPU time of `repeat` reads and the microseconds per entry, and writes
bench/results/safetensors-header.json. tests/onboard/test_safetensors_header.py checks the work this does (one
read of 8 + N header bytes, one JSON parse, one check per entry); the time lives here, where the machine it ran
on is named beside it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import struct
import tempfile
import time
from pathlib import Path

from onboard.release.safetensors_header import read_header

RESULTS = Path(__file__).resolve().parent / "results" / "safetensors-header.json"


def write_file(path: Path, entries: int) -> Path:
    header = {f"layers.{i}.w": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [32 * i, 32 * (i + 1)]}
              for i in range(entries)}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(32 * entries))
    return path


def best(path: Path, repeat: int) -> tuple[float, float]:
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        read_header(path)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wall, cpu = best(write_file(Path(tmp) / "big.safetensors", args.entries), args.repeat)
    result = {"entries": args.entries, "repeat": args.repeat, "best_wall_s": wall, "best_cpu_s": cpu,
              "us_per_entry": 1e6 * wall / args.entries, "machine": platform.node(), "processor": platform.processor(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    print(f"| entries | best wall s | best CPU s | us/entry |\n|---|---|---|---|\n"
          f"| {args.entries} | {wall:.3f} | {cpu:.3f} | {result['us_per_entry']:.1f} |")
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
