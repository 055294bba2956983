"""`onboard new-model`: write the package a release needs for alignment and training, atomically.

Everything is written into a temporary sibling folder, which is renamed to PKG at the end: an
interrupted or failed run leaves no half-written package behind.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
from pathlib import Path

import yaml

from onboard.errors import OnboardError
from onboard.gap import analyze
from onboard.manifest import read_manifest
from onboard.recognize import recognize
from onboard.render import gap_markdown
from onboard.weight_map import build_weight_map


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_package(model_dir: Path, out: Path, gpu_mem_gib: float = 80.0, lora_rank: int = 16, seq_len: int = 4096):
    """Returns (package path, gap report)."""
    model_dir, out = Path(model_dir).resolve(), Path(out)
    if out.exists():
        raise OnboardError(out, None, "package folder already exists; choose another --out or remove it")
    manifest = read_manifest(model_dir)
    spec = recognize(manifest)
    report = analyze(spec, manifest, gpu_mem_gib, lora_rank, seq_len)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        _write_files(tmp, model_dir, manifest, spec, report)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, report


def _write_files(pkg: Path, model_dir: Path, manifest, spec, report) -> None:
    (pkg / "spec.json").write_text(spec.model_dump_json(indent=2))
    (pkg / "weight_map.json").write_text(json.dumps(build_weight_map(spec, report.weights.unexpected), indent=1))
    (pkg / "gap_report.json").write_text(report.model_dump_json(indent=2))
    (pkg / "gap_report.md").write_text(gap_markdown(report))
    if manifest.vision_config is not None:
        (pkg / "vision_config.json").write_text(json.dumps(manifest.vision_config, indent=2))
    (pkg / "alignment").mkdir()
    ops = sorted({o.op for o in report.ops})
    package = {
        "source": {"path": str(model_dir), "family": spec.family, "architecture": spec.architecture,
                   "config_sha256": _sha256(model_dir / "config.json")},
        "spec_hash": spec.spec_hash(),
        "ops_used": ops,
        "generated_ops": [],
        "status": "gaps" if report.summary["gaps_remain"] else "ready-for-alignment",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    (pkg / "package.yaml").write_text(yaml.safe_dump(package, sort_keys=False))
