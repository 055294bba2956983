"""Run the alignment tiers in order, each only when the one below passed, and write PKG/alignment/
(report.json, tier<N>.json, and baseline.json on the first passing run)."""
from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch

from onboard import package_io
from onboard.align.confined import align_confined
from onboard.align.progress import Progress
from onboard.align.report import AlignmentReport, Check, Divergence, TierResult, tier_result
from onboard.align.tiers.tier0_ops import tier0
from onboard.align.tiers.tier1_layers import distinct_layers, tier1
from onboard.align.tiers.tier2_model import tier2
from onboard.align.tiers.tier2_training import training_checks
from onboard.align.tiers.tier3 import tier3
from onboard.align.tiers.tier4 import Target, tier4, tier4_target
from onboard.align.tiers.vision import vision_checks
from onboard.errors import BadInput
from onboard.package.approved_ops import approved_hashes
from onboard.package.files import read_manifest_file
from onboard.package.reader import Package, read_package
from onboard.plan.search import Cluster
from onboard.recognize.model_references import register_references
from runtime.errors import InputFileError, PackageOpRefused
from runtime.package_ops import OpFile, check_loadable, read_op_files, register_op_files, tables_restored, unapproved
from runtime.parallel.placement import MeshShape
from runtime.spec import ModelSpec, read_spec

# Alignment of large releases runs a prefix of the model (both sides) holding every distinct layer kind.
MAX_ALIGN_LAYERS = 8


def layers_to_run(spec: ModelSpec, max_layers: int = MAX_ALIGN_LAYERS) -> int:
    """At most max_layers, but never fewer than the prefix that holds every distinct layer kind."""
    kinds = distinct_layers(spec, spec.num_layers)
    return max(max(kinds.values()) + 1, min(spec.num_layers, max_layers))


def run_alignment(pkg: Path, tiers: list[int], model_dir: Path | None = None, tamper=None,
                  progress: Progress | None = None, max_layers: int = MAX_ALIGN_LAYERS,
                  cluster: Cluster | None = None, mesh: MeshShape | None = None) -> AlignmentReport:
    """`model_dir` overrides the release folder package.yaml records; `tamper(model)` edits our model after
    loading (tests break an op on purpose); `cluster` is tier 4's target (required for it), `mesh` the mesh
    it checks instead of the plan's choice. A package whose op files the user has not approved is aligned in
    a confined process (onboard/align/confined.py): its code never runs in this one."""
    pkg, progress = Path(pkg), progress or Progress()
    inputs = read_package(pkg, model_dir)
    for name in ["report.json", "baseline.json", *(f"tier{tier}.json" for tier in tiers)]:
        package_io.check_writable(pkg, pkg / "alignment" / name)
    files = read_op_files(pkg)
    check_loadable(files)
    strangers = unapproved(files, approved_hashes())
    _require_listed(pkg, strangers)
    if strangers:
        if tamper is not None:
            raise ValueError("tamper edits a model in this process: approve the package's ops first")
        report = align_confined(pkg, inputs, strangers[0], tiers, progress, max_layers, cluster, mesh)
    else:
        report = align_in_process(pkg, inputs, files, tiers, tamper, progress, max_layers, cluster, mesh)
    _write(pkg, report)
    return report


def _require_listed(pkg: Path, files: list[OpFile]) -> None:
    """Unapproved op files run (confined) only when package.yaml lists them as generated ops, with their tests: a
    file nobody generated is no op of the package, and nothing of it runs anywhere (exit 3 naming it)."""
    listed = {Path(entry.get(key, "")).as_posix() for entry in read_manifest_file(pkg).generated_ops
              if isinstance(entry, dict) for key in ("file", "test_file")}
    listed |= {f"ops/test_{Path(name).name}" for name in listed if name.startswith("ops/")}
    for f in files:
        if f.path.relative_to(pkg).as_posix() not in listed:
            raise PackageOpRefused(f.path, "is not approved, and package.yaml's generated_ops does not list it: no "
                                           f"generated op of this package; remove it, or review it and run "
                                           f"`onboard approve {pkg}`")


def align_in_process(pkg: Path, inputs: Package, files: list[OpFile], tiers: list[int], tamper,
                     progress: Progress, max_layers: int, cluster: Cluster | None,
                     mesh: MeshShape | None) -> AlignmentReport:
    """The tiers in this process, with the package's op `files` registered: files the user approved, or any
    inside the confined child."""
    goal = tier4_target(pkg, cluster, mesh) if 4 in tiers else None
    spec = read_spec(inputs.spec)
    num_layers = layers_to_run(spec, max_layers)
    if num_layers < spec.num_layers and min(tiers) < 3:
        progress.note(f"aligning the first {num_layers} of {spec.num_layers} layers "
                      "(every distinct layer kind is among them)")
    torch.manual_seed(0)
    # the package's generated ops run in the runtime (for this package only: a refused trial candidate must
    # not stay registered), the model's own functions are their reference
    with tables_restored():
        register_op_files(files)
        register_references(pkg)
        results, divergence = _run_tiers(sorted(tiers), spec, inputs, num_layers, tamper, progress, goal)
    return AlignmentReport(package=str(pkg.resolve()), source=str(inputs.source), spec_hash=inputs.spec_hash,
                           tiers=results, first_divergence=divergence,
                           passed=all(t.passed for t in results) and len(results) == len(tiers))


def _run_tiers(tiers: list[int], spec: ModelSpec, inputs: Package, num_layers: int, tamper, progress: Progress,
               goal: Target | None) -> tuple[list[TierResult], Divergence | None]:
    """Each tier only when the one below passed."""
    results, divergence = [], None
    for tier in tiers:
        if results and not results[-1].passed:
            progress.note(f"tier {tier}: skipped (tier {results[-1].tier} failed)")
            break
        progress.start_tier(tier)
        try:
            checks, found = _run_tier(tier, spec, inputs, num_layers, tamper, progress, goal)
        except (BadInput, InputFileError):
            raise  # the package does not fit its release: bad input, one line
        except Exception as err:  # a load or run failure is a failed check, never a traceback
            checks, found = [failure_check(tier, err)], None
        divergence = divergence or found
        results.append(tier_result(tier, checks))
        progress.end_tier(results[-1].summary())
    return results, divergence


def _run_tier(tier: int, spec: ModelSpec, inputs: Package, num_layers: int, tamper, progress: Progress,
              goal: Target | None) -> tuple[list[Check], Divergence | None]:
    """spec: the package's, typed (read_package's is spec.json's data, the form its other readers take)."""
    weight_map, source = inputs.weight_map, inputs.source
    if tier == 0:
        return tier0(spec, progress=progress, weight_map=weight_map, source=source), None
    if tier == 1:
        return tier1(spec, weight_map, source, num_layers, progress=progress), None
    if tier == 2:
        # the training group, and the vision group of multimodal releases, counted from the tier's first line
        progress.plan(1 + (inputs.vision_config is not None))
        checks, divergence = tier2(spec, weight_map, source, num_layers, tamper=tamper, progress=progress)
        if inputs.vision_config is not None:
            checks += vision_checks(spec, weight_map, source, inputs.vision_config, num_layers, progress=progress)
        checks += training_checks(spec, weight_map, source, inputs.lora_plan, num_layers, progress=progress)
        return checks, divergence
    if tier == 3:
        return tier3(spec, weight_map, source, inputs.lora_plan, progress=progress), None
    if tier == 4:
        return tier4(spec, weight_map, source, goal, progress=progress), None
    raise BadInput(None, "--tiers", f"tier {tier} is not available here (0 to 4)")


def failure_check(tier: int, err: Exception) -> Check:
    """What failed and where: the message (naming the tensor or module) and the innermost frame."""
    frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    at = f" at {Path(frame.filename).name}:{frame.lineno} ({frame.name})" if frame else ""
    return Check(tier=tier, name=f"tier{tier}/run", metric="-", value=float("inf"), tolerance=0.0, verdict="fail",
                 detail=f"{type(err).__name__}: {str(err)[:300]}{at}")


def _write(pkg: Path, report: AlignmentReport) -> None:
    """Inside the package only: a symlinked alignment/ or report file is refused, never written through."""
    folder = pkg / "alignment"
    package_io.write_text(pkg, folder / "report.json", report.model_dump_json(indent=2))
    for tier in report.tiers:
        package_io.write_text(pkg, folder / f"tier{tier.tier}.json", tier.model_dump_json(indent=2))
    if report.passed and not os.path.lexists(folder / "baseline.json"):
        package_io.write_text(pkg, folder / "baseline.json", report.model_dump_json(indent=2))
