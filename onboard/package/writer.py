"""`onboard new-model`: write the package a release needs for alignment and training, atomically.

`write` is the one writer of the package's files (package.yaml, spec.json, weight_map.json, gap_report.json/.md,
plan.yaml, lora.yaml, ops/, the workflow; review's status through `record_outcome`), from `PackageContents`
decided before: the onboarding graph's state, or `package_contents` for callers outside the graph.

Everything is written into a temporary sibling folder `.PKG.partial-PID`, which is renamed to
PKG at the end: a failed run leaves no half-written package and no parent folder it made; one
killed outright leaves its partial folder, which the next run removes once that PID is gone.
Runs on the same PKG are serialized by a lock file beside it: the second one fails with exit 2.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import yaml

from onboard.errors import BadInput
from onboard.gap.generated import GeneratedOp, mark_generated
from onboard.gap.render import gap_markdown
from onboard.gap.report import GapReport, analyze
from onboard.package.approved_ops import approve, steps_digest
from onboard.package.derivation import SpecStep, derive_spec, derive_weight_map
from onboard.package.workflow import model_slug, write_workflow
from onboard.plan.render import plan_yaml
from onboard.plan.search import Cluster, ParallelPlan, package_plan
from onboard.release.hashes import shard_records
from onboard.release.manifest import Manifest, read_manifest
from runtime import defaults
from runtime.lora.plan import default_lora_file, lora_yaml_text
from runtime.spec import ModelSpec


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class PackageContents:
    """What a package holds, decided before a file is written: the onboarding graph's state (agents/nodes/package.py)
    or `package_contents` for callers outside the graph. The writer renders these and computes nothing else
    (the weight map and lora.yaml follow from the spec and the release, the derivation every reader re-runs)."""
    model_dir: Path  # the release, resolved
    manifest: Manifest
    spec: ModelSpec  # the release recognized and changed by `spec_steps` (onboard/package/derivation.py)
    spec_steps: list[SpecStep]
    report: GapReport  # the final gap report: generated ops marked
    plan: ParallelPlan  # plan.yaml's
    lora_rank: int
    generated: list[GeneratedOp] = field(default_factory=list)  # written into PKG/ops/


def write_package(model_dir: Path, out: Path, gpu_mem_gib: float = defaults.GPU_MEM_GIB,
                  lora_rank: int = defaults.LORA_RANK, seq_len: int = defaults.SEQ_LEN, gpus: int = defaults.GPUS,
                  gpus_per_node: int = defaults.GPUS_PER_NODE, generated: Sequence[GeneratedOp] = (),
                  spec_steps: Sequence[SpecStep] = ()):
    """For callers outside the onboarding graph: the package's contents computed as the graph computes them
    (`package_contents`), then written by the one writer (`write`). Returns (package path, gap report)."""
    model_dir, out = Path(model_dir).resolve(), Path(out).absolute()
    check_out(out, model_dir)
    contents = package_contents(model_dir, gpu_mem_gib, lora_rank, seq_len, gpus, gpus_per_node, generated, spec_steps)
    return write(out, contents), contents.report


def package_contents(model_dir: Path, gpu_mem_gib: float = defaults.GPU_MEM_GIB, lora_rank: int = defaults.LORA_RANK,
                     seq_len: int = defaults.SEQ_LEN, gpus: int = defaults.GPUS,
                     gpus_per_node: int = defaults.GPUS_PER_NODE, generated: Sequence[GeneratedOp] = (),
                     spec_steps: Sequence[SpecStep] = ()) -> PackageContents:
    """plan.yaml is the parallel plan for `gpus` GPUs of gpu_mem_gib.
    `generated`: validated operator candidates, written into PKG/ops/ and marked `generated` in the gap report.
    `spec_steps`: what the onboarding graph changed after recognition (validated explanations of unrecognized
    items, demotions to the release's own modules), in order: the spec is derived from the release through
    them (onboard/package/derivation.py), the way every reader of the package derives it again."""
    model_dir = Path(model_dir).resolve()
    manifest = read_manifest(model_dir)
    spec = derive_spec(manifest, list(spec_steps))
    report = mark_generated(analyze(spec, manifest, gpu_mem_gib, lora_rank, seq_len), list(generated))
    plan = package_plan(spec, Cluster(gpus, gpu_mem_gib, gpus_per_node), seq_len, lora_rank)
    return PackageContents(model_dir, manifest, spec, list(spec_steps), report, plan, lora_rank, list(generated))


def write(out: Path, contents: PackageContents) -> Path:
    """Writes `contents` as the package `out`, atomically (a temporary sibling renamed at the end); returns `out`."""
    out, model_dir = Path(out).absolute(), contents.model_dir
    with made_parents(out.parent), locked(out):
        check_out(out, model_dir)
        _remove_stale_partials(out)
        tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
        try:
            tmp.mkdir()
            weight_map = _write_files(tmp, out, contents)
            _write_lora_yaml(tmp, contents.spec, weight_map, contents.lora_rank)
            (tmp / "plan.yaml").write_text(plan_yaml(contents.plan))
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def record_outcome(pkg: Path, status: str, reasons: list[str]) -> None:
    """package.yaml's `status` and `reasons` once alignment and review have decided them (replaced atomically)."""
    path = Path(pkg) / "package.yaml"
    package = yaml.safe_load(path.read_text())
    replace_text(path, yaml.safe_dump({**package, "status": status, "reasons": reasons}, sort_keys=False))


def replace_text(path: Path, text: str) -> None:
    """`path` holds `text` or its old content, never a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_lora_yaml(pkg: Path, spec: ModelSpec, weight_map: dict[str, dict], lora_rank: int) -> None:
    """Every attention projection at the budget's rank, alpha twice the rank (runtime/defaults.py)."""
    lora = default_lora_file(spec, weight_map)
    lora = lora.model_copy(update={"rank": lora_rank, "alpha": defaults.LORA_ALPHA_PER_RANK * lora_rank})
    (pkg / "lora.yaml").write_text(lora_yaml_text(lora))


def check_out(out: Path, model_dir: Path) -> None:
    if out.exists() or out.is_symlink():
        raise BadInput(out, None, "package folder already exists; choose another --out or remove it")
    if out.resolve().is_relative_to(model_dir):
        raise BadInput(out, "--out", f"inside the model folder {model_dir}; the release is read, never written")


@contextlib.contextmanager
def made_parents(folder: Path):
    """Create the missing parents of PKG; remove the ones made here if the run fails."""
    missing = [p for p in [folder, *folder.parents] if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        yield
    except OSError as exc:
        _remove_empty(missing)
        raise BadInput(folder, "--out", f"cannot write the package there ({exc.strerror or exc})") from None
    except BaseException:
        _remove_empty(missing)
        raise


def _remove_empty(folders: list[Path]) -> None:
    for made in folders:  # deepest first; a folder something else wrote into stays
        with contextlib.suppress(OSError):
            made.rmdir()


@contextlib.contextmanager
def locked(out: Path):
    """flock on `.PKG.lock` beside PKG: released by the kernel even when the holder is killed."""
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BadInput(out, None, f"another `onboard new-model` is writing this package (lock {lock_path})") from None
        try:
            yield
        finally:
            # unlinked while held: a run waiting on this file fails cleanly, a later one makes a new lock
            lock_path.unlink(missing_ok=True)


def _remove_stale_partials(out: Path) -> None:
    """`.PKG.partial-PID` folders whose process is gone (killed before it could clean up)."""
    stem = f".{out.name}.partial-"
    for partial in out.parent.iterdir():
        pid = partial.name.removeprefix(stem)
        if partial.name.startswith(stem) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def release_path(model_dir: Path, out: Path) -> str:
    """The release folder relative to PKG, so that package and release can move together to another machine;
    absolute when no relative path exists (another drive)."""
    try:
        return os.path.relpath(model_dir, out.parent.resolve() / out.name)
    except ValueError:
        return str(model_dir)


def _write_files(pkg: Path, out: Path, c: PackageContents) -> dict[str, dict]:
    """Every file but lora.yaml and plan.yaml; the weight map written."""
    spec, report, model_dir = c.spec, c.report, c.model_dir
    weight_map = derive_weight_map(spec, c.manifest)
    (pkg / "spec.json").write_text(spec.model_dump_json(indent=2))
    (pkg / "weight_map.json").write_text(json.dumps(weight_map, indent=1))
    (pkg / "gap_report.json").write_text(report.model_dump_json(indent=2))
    (pkg / "gap_report.md").write_text(gap_markdown(report))
    if c.manifest.vision_config is not None:
        (pkg / "vision_config.json").write_text(json.dumps(c.manifest.vision_config, indent=2))
    (pkg / "alignment").mkdir()
    ops = sorted({o.op for o in report.ops})
    package = {
        "source": {"path": release_path(model_dir, out), "absolute": str(model_dir), "family": spec.family,
                   "architecture": spec.architecture, "config_sha256": _sha256(model_dir / "config.json"),
                   "shards": shard_records(c.manifest)},
        "spec_hash": spec.spec_hash(),
        "spec_steps": _approved_steps(out, c.spec_steps),
        "ops_used": ops,
        "generated_ops": _write_generated(pkg, out, c.generated),
        "status": "gaps" if report.summary["gaps_remain"] else "ready-for-alignment",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    (pkg / "package.yaml").write_text(yaml.safe_dump(package, sort_keys=False))
    write_workflow(pkg, model_slug(model_dir))
    return weight_map


def _approved_steps(out: Path, spec_steps: list[SpecStep]) -> list[dict]:
    """package.yaml's spec_steps, approved as new-model's own decisions (the user's store: training needs it)."""
    steps = [step.model_dump() for step in spec_steps]
    if steps:
        approve({steps_digest(steps): "package.yaml:spec_steps"}, out, by="onboard new-model (decided them)")
    return steps


def _write_generated(pkg: Path, out: Path, generated: Sequence[GeneratedOp]) -> list[dict]:
    """PKG/ops/<file>.py and test_<file>.py per generated op, approved as new-model's own output (the user's
    store: loading needs it); the package.yaml entries, with each file's sha256 for the reviewer."""
    if generated:
        (pkg / "ops").mkdir()
    sha = {}
    for op in generated:
        for name, text in ((op.file, op.source), (f"test_{op.file}", op.test_source)):
            data = text.encode()
            (pkg / "ops" / name).write_bytes(data)
            sha[f"ops/{name}"] = hashlib.sha256(data).hexdigest()
    if sha:
        approve({digest: name for name, digest in sha.items()}, out, by="onboard new-model (generated it)")
    return [{"kind": op.kind, "name": op.name, "file": f"ops/{op.file}", "sha256": sha[f"ops/{op.file}"],
             "test_sha256": sha[f"ops/test_{op.file}"], "reference": op.reference,
             "closes": op.closes, "evidence": op.evidence} for op in generated]
