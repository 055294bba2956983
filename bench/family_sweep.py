"""Run the family sweep over every MoE family of the installed transformers; write docs/families.md.

One process per family (a family that hangs or crashes the interpreter cannot take the others
down), --jobs at a time. Results: bench/results/families.json; the table: docs/families.md.

    python bench/family_sweep.py [--families a b ...] [--jobs 2] [--timeout 600] [--out MD] [--json JSON]
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from onboard.family_sweep import FamilyResult, StepResult, families_markdown, model_classes, moe_families, summary  # noqa: E402


def run_one(family: str, workdir: Path, timeout: int) -> FamilyResult:
    cmd = [sys.executable, "-m", "onboard.family_sweep", family, str(workdir / family)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return FamilyResult(family=family, model_class=model_classes()[family], built=True,
                            steps={"sweep": StepResult(exit_code=None, traceback=f"timed out after {timeout} s")})
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return FamilyResult(family=family, model_class=model_classes()[family], built=True,
                            steps={"sweep": StepResult(exit_code=None, traceback=proc.stderr[-2000:])})
    return FamilyResult.model_validate_json(lines[-1])


def write(results: list[FamilyResult], out: Path, out_json: Path, command: str, date: str) -> None:
    results = sorted(results, key=lambda r: r.family)
    out.write_text(families_markdown(results, command, date))
    out_json.write_text(
        json.dumps({"command": command, "date": date, "summary": summary(results),
                    "families": [r.model_dump() for r in results]}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--out", default=str(ROOT / "docs" / "families.md"), help="the Markdown table")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "families.json"), help="the results")
    args = parser.parse_args()
    families, unreadable = moe_families()
    results = [FamilyResult(family=f, model_class=model_classes()[f], built=False, not_built_reason=why)
               for f, why in unreadable.items() if not args.families]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "python bench/family_sweep.py" + (f" --families {' '.join(args.families)}" if args.families else "")
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        runs = [pool.submit(run_one, f, Path(tmp), args.timeout) for f in args.families or families]
        # written after every family, so an interrupted sweep leaves what it found
        for run in as_completed(runs):
            results.append(run.result())
            write(results, Path(args.out), Path(args.json), command, date)
    print(json.dumps(summary(results)))


if __name__ == "__main__":
    main()
