"""The one reader of a package: what align, train, bench, export and demo load, validated the same way for all.

A package is untrusted input (it may arrive as a pull request), and a command trusts nothing in it that it
could not derive again from the release. In order, each failure a BadInput (exit 2) naming file and key:
- the files: read through onboard/package_io.py (no symlink followed, only regular files, size capped),
  package.yaml, spec.json and weight_map.json against their schemas, spec.json against package.yaml's
  spec_hash (onboard/package/files.py);
- the release: its config.json and every weight shard as new-model read them (sha256, and per shard its
  size and sha256: onboard/release/hashes.py);
- the derivation: the release recognized again with package.yaml's spec_steps applied must equal spec.json,
  and the weight map derived from that spec must equal weight_map.json (onboard/package/derivation.py), so a
  spec or map edited and re-hashed (a top-k, an eps, k and v swapped, a row range) is refused;
- vision_config.json equal to the release's, lora.yaml (rank within the model's width, finite alpha, targets
  that exist) and plan.yaml's memory section.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, ValidationError

from onboard import package_io
from onboard.package.files import (load_yaml, read_manifest_file, read_spec, read_vision_config,
                                         read_weight_map, release_folder)
from onboard.errors import BadInput
from onboard.package.derivation import derive_spec, derive_weight_map
from onboard.release.hashes import verify_shards
from onboard.release.manifest import read_manifest


class MemoryPlan(BaseModel):
    """plan.yaml's `memory:` section: op kinds to recompute and to offload (runtime/memory.py)."""

    model_config = ConfigDict(extra="forbid")
    recompute: list[str] = []
    offload: list[str] = []


@dataclass(frozen=True)
class Package:
    path: Path
    spec: dict  # ModelSpec as plain JSON data, the form runtime/ reads
    spec_hash: str
    weight_map: dict[str, dict]
    source: Path  # the release folder both sides load weights from
    vision_config: Optional[dict]
    lora_plan: Path  # PKG/lora.yaml, read by tier 2's and tier 3's training checks
    lora: Any  # runtime.lora.LoraConfig of lora.yaml
    memory: MemoryPlan  # plan.yaml's memory section


def read_package(pkg: Path, model_dir: Path | None = None) -> Package:
    pkg = Path(pkg)
    manifest_file = read_manifest_file(pkg)
    spec = read_spec(pkg, manifest_file.spec_hash)
    weight_map = read_weight_map(pkg)
    source = release_folder(pkg, manifest_file.source, model_dir)
    release = read_manifest(source)
    verify_shards(release, manifest_file.source.shards, pkg / "package.yaml")
    spec_data = json.loads(spec.model_dump_json())
    _require_equal(pkg / "spec.json", spec_data, _as_json(derive_spec(release, manifest_file.spec_steps)),
                   "the spec `onboard new-model` derives from the release")
    _require_equal(pkg / "weight_map.json", weight_map, derive_weight_map(spec, release),
                   "the weight map `onboard new-model` derives from the release")
    vision = _vision_config(pkg, release) if spec.vision is not None else None
    lora = read_lora_plan(pkg, weight_map, spec.hidden_size)
    return Package(pkg, spec_data, manifest_file.spec_hash, weight_map, source, vision, pkg / "lora.yaml", lora,
                   read_memory_plan(pkg))


def _as_json(model) -> Any:
    return json.loads(model.model_dump_json())


def _require_equal(path: Path, got: Any, expected: Any, what: str) -> None:
    key, want, have = _first_difference(expected, got)
    if key is not None:
        raise BadInput(path, key or None, f"{_short(have)} where {what} has {_short(want)}: the file changed after "
                                          "`onboard new-model`, or this onboard derives another (run `onboard "
                                          "new-model` again, or restore the file)")


def _first_difference(expected: Any, got: Any, key: str = "") -> tuple[Optional[str], Any, Any]:
    """(dotted key, expected value, value found) of the first place the two differ; key None when equal."""
    if isinstance(expected, dict) and isinstance(got, dict):
        for name in [*expected, *(name for name in got if name not in expected)]:
            found = _first_difference(expected.get(name, _ABSENT), got.get(name, _ABSENT), _join(key, name))
            if found[0] is not None:
                return found
        return None, None, None
    if isinstance(expected, list) and isinstance(got, list) and len(expected) == len(got):
        for index, (a, b) in enumerate(zip(expected, got)):
            found = _first_difference(a, b, _join(key, str(index)))
            if found[0] is not None:
                return found
        return None, None, None
    if expected == got and type(expected) is type(got):
        return None, None, None
    return key, expected, got


class _Absent:
    def __repr__(self) -> str:
        return "nothing"


_ABSENT = _Absent()


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _vision_config(pkg: Path, release) -> dict:
    config = read_vision_config(pkg)
    _require_equal(pkg / "vision_config.json", config, release.vision_config, "the release's vision config")
    return config


def read_lora_plan(pkg: Path, weight_map: dict[str, dict], hidden_size: int | None = None):
    """lora.yaml as a runtime LoraConfig; a rank beyond the model's hidden size is refused before any factor
    is allocated (it adds nothing a full-width update would not, and a huge one only exhausts memory)."""
    from runtime.errors import InputFileError
    from runtime.lora.plan import lora_config

    path = pkg / "lora.yaml"
    try:
        config = lora_config(package_io.read_text(pkg, path), path, weight_map)
    except InputFileError as err:
        raise BadInput(err.path, err.key, err.message) from None
    if hidden_size is not None and config.rank > hidden_size:
        raise BadInput(path, "rank", f"{config.rank} exceeds the model's hidden size {hidden_size}: a LoRA "
                                     "rank is at most the width of the layers it adapts")
    if not math.isfinite(config.alpha / config.rank):
        raise BadInput(path, "alpha", f"{config.alpha} over rank {config.rank} is not a finite scale")
    return config


def read_memory_plan(pkg: Path) -> MemoryPlan:
    """plan.yaml's memory section (none: nothing recomputed or offloaded)."""
    path = pkg / "plan.yaml"
    if not os.path.lexists(path):
        return MemoryPlan()
    plan = load_yaml(pkg, "plan.yaml")
    if not isinstance(plan, (dict, type(None))):
        raise BadInput(path, None, f"expected a mapping at the top level, got {type(plan).__name__}")
    section = (plan or {}).get("memory")
    try:
        return MemoryPlan.model_validate(section or {})
    except ValidationError as err:
        raise BadInput(path, "memory", f"expected {{recompute: [kinds], offload: [kinds]}} "
                                       f"({err.errors()[0]['msg']})") from None
