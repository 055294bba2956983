"""Alignment of a package whose op files the user has not approved: the whole tier run in a child process
that bubblewrap confines (onboard/sandbox/run.py, run_project_module), so the package's code never runs in the
user's process. The child sees the system, the interpreter and its libraries, this project's code, the package
and the release read-only, and one empty work folder; no network, no home, no .git, no secrets in its
environment. It writes its report there; this process validates it and writes PKG/alignment/ as an in-process
run would. The CI workflow takes this path: on a fresh machine nothing is approved.

The verdict is the child's: the package's code runs in the same process as the checks, so a hostile package
can fake its own report; what confinement guarantees is that it reaches nothing of the user's.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

from onboard.align.progress import Progress
from onboard.align.report import AlignmentReport, Check, tier_result
from onboard import package_io
from onboard.errors import BadInput, printable
from onboard.exit_codes import Exit
from onboard.package.reader import Package
from onboard.plan.search import Cluster
from runtime.errors import PackageOpRefused
from runtime.package_ops import OpFile
from runtime.parallel.placement import MeshShape

# the child's entry, a module of its own: running it needs nothing of this one
CHILD_MODULE = "onboard.align.confined_child"
REQUEST, REPORT, REFUSAL = "request.json", "report.json", "refused.json"
# A report of the largest packages is far below this; a child writing more is not writing a report.
MAX_REPORT_BYTES = 64 << 20
# What the child may know of the user's environment: thread counts and the devices to use, nothing else.
PASSED_ENV = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")


def align_limits():
    """Room for a whole alignment (hours, the machine's memory), still bounded: a run that never ends is killed."""
    from onboard.sandbox.run import Limits

    wall_s = 6 * 3600
    memory_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
    return Limits(wall_s=wall_s, memory_mib=memory_mib, cpu_s=wall_s * (os.cpu_count() or 1), file_mib=4096,
                  open_files=4096, processes=4096, shm_mib=1024, tmp_mib=4096)


def align_confined(pkg: Path, inputs: Package, stranger: OpFile, tiers: list[int], progress: Progress,
                   max_layers: int, cluster: Cluster | None, mesh: MeshShape | None) -> AlignmentReport:
    """The tiers run by the confined child; `stranger` is the first unapproved file (named to the user)."""
    from onboard.sandbox.run import available_mode, run_project_module

    if available_mode() != "bwrap":
        raise PackageOpRefused(stranger.path, f"is not approved, and package code cannot be confined here (no working "
                                              f"bubblewrap): review it, then run `onboard approve {pkg}`, or install "
                                              "bubblewrap")
    progress.note(f"{stranger.path} is not approved: aligning in a confined process (no network, no home, "
                  "the package read-only)")
    with tempfile.TemporaryDirectory(prefix="onboard-align-") as tmp:
        work = Path(tmp)
        request = {"pkg": str(pkg.resolve()), "model_dir": str(inputs.source), "tiers": tiers, "max_layers": max_layers,
                   "cluster": cluster and dataclasses.asdict(cluster), "mesh": mesh and dataclasses.asdict(mesh)}
        (work / REQUEST).write_text(json.dumps(request))
        env = {key: os.environ[key] for key in PASSED_ENV if key in os.environ}
        env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(work / ".hf")}
        result = run_project_module(CHILD_MODULE, [str(work / REQUEST)], work, readable=_readable(pkg, inputs.source),
                                    limits=align_limits(), env=env)
        for line in result.stderr.splitlines():
            progress.note(f"  confined: {printable(line)[:300]}")
        return _outcome(work, result, pkg, inputs, tiers)


def _readable(pkg: Path, release: Path) -> list[Path]:
    """The package and the release, and the files the release's links point to (a hub cache's snapshot links
    into its blobs)."""
    targets = [entry.resolve() for entry in release.iterdir() if entry.is_symlink() and entry.resolve().exists()]
    return [pkg.resolve(), release.resolve(), *targets]


def _outcome(work: Path, result, pkg: Path, inputs: Package, tiers: list[int]) -> AlignmentReport:
    """The child's report, checked; its refusal, raised as this process would; else a failed run."""
    refusal = _child_json(work / REFUSAL, 64 << 10)
    if isinstance(refusal, dict) and refusal.get("exit") == Exit.GAPS:
        raise PackageOpRefused(printable(str(refusal.get("path")))[:500], printable(str(refusal.get("reason")))[:500])
    if isinstance(refusal, dict) and refusal.get("exit") == Exit.BAD_INPUT:
        raise BadInput(str(refusal.get("path"))[:500], str(refusal.get("key"))[:200] if refusal.get("key") else None,
                       str(refusal.get("reason"))[:500])
    data = _child_json(work / REPORT, MAX_REPORT_BYTES)
    try:
        report = AlignmentReport.model_validate(data)
    except ValueError:
        report = None
    if report is not None and report.spec_hash == inputs.spec_hash and {t.tier for t in report.tiers} <= set(tiers):
        return report.model_copy(update={"package": str(pkg.resolve()), "source": str(inputs.source)})
    why = "timed out" if result.timed_out else f"exit code {result.returncode}"
    last = printable(result.stderr.strip().splitlines()[-1])[:300] if result.stderr.strip() else "no output"
    check = Check(tier=min(tiers), name=f"tier{min(tiers)}/confined-run", metric="-", value=float("inf"),
                  tolerance=0.0, verdict="fail", detail=f"the confined alignment gave no valid report ({why}): {last}")
    return AlignmentReport(package=str(pkg.resolve()), source=str(inputs.source), spec_hash=inputs.spec_hash,
                           tiers=[tier_result(min(tiers), [check])], passed=False)


def _child_json(path: Path, limit: int):
    """A JSON file the child wrote into its work folder, read without following links, at most `limit` bytes;
    None when there is none or it is not that."""
    try:
        return json.loads(package_io.read_bytes(path.parent, path, limit))
    except (BadInput, ValueError):
        return None