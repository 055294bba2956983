"""The schemas of a package's files and the file-level checks onboard/package/reader.py runs first.

package.yaml, spec.json and weight_map.json are checked against their schemas; spec.json must list
the layers it counts and hash to package.yaml's spec_hash; the release folder (package.yaml's
`source.path`, relative to PKG so both can move together, else `source.absolute`, or --model-dir) must
hold the config.json that new-model read. Every file is read through onboard/package_io.py (no symlink
followed, regular files only). Any mismatch is a BadInput naming the file and the key.
"""
from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path
from typing import Annotated, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, RootModel, ValidationError

from onboard import package_io
from onboard.errors import BadInput
from onboard.package.derivation import SpecStep
from onboard.release.hashes import ShardRecord
from runtime.formats.scheme import StoredEntry
from runtime.spec import ModelSpec


class SourceRecord(BaseModel):
    path: str  # the release folder, relative to PKG where new-model could write it so
    absolute: Optional[str] = None  # where it was when new-model ran: tried when `path` is not there
    family: str
    architecture: str
    config_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    shards: dict[str, ShardRecord]  # shard file -> size and sha256 when new-model read it (onboard/release/hashes.py)


class PackageManifest(BaseModel):
    """package.yaml; keys beyond these are allowed (later stages add their own)."""
    source: SourceRecord
    spec_hash: str = Field(pattern=r"^[0-9a-f]{16}$")
    spec_steps: list[SpecStep] = []  # what the onboarding graph changed after recognition (package_derivation.py)
    ops_used: list[str]
    generated_ops: list
    status: str
    created: Union[datetime.datetime, str]


class WeightMapEntry(BaseModel):
    """One released tensor's way into the runtime model (see onboard/package/weight_map.py)."""
    model_config = ConfigDict(extra="forbid")
    # null: loaded by transformers into the own module named, or (no own module) read by nothing, a listed gap
    target: Optional[Annotated[str, Field(min_length=1)]]
    expert: Optional[NonNegativeInt]
    rows: Optional[tuple[NonNegativeInt, NonNegativeInt]]
    transpose: bool
    flatten: bool
    own_module: Optional[Annotated[str, Field(min_length=1)]] = None
    # the released weight is stored quantized: its format, codes and scale tensors (runtime/formats/scheme.py)
    stored: Optional[StoredEntry] = None


class WeightMap(RootModel[Annotated[dict[str, WeightMapEntry], Field(min_length=1)]]):
    """weight_map.json: released tensor name -> entry."""


def require_package_folder(pkg: Path) -> None:
    if not pkg.exists():
        raise BadInput(pkg, None, "does not exist")
    if not pkg.is_dir():
        raise BadInput(pkg, None, "not a folder: expected a package written by `onboard new-model`")
    if not (pkg / "package.yaml").is_file():
        raise BadInput(pkg / "package.yaml", None, "missing: not a package written by `onboard new-model`")


def read_manifest_file(pkg: Path) -> PackageManifest:
    """package.yaml, validated."""
    require_package_folder(pkg)
    return validated(pkg / "package.yaml", load_yaml(pkg, "package.yaml"), PackageManifest)


def load_yaml(pkg: Path, name: str):
    path = pkg / name
    try:
        return yaml.safe_load(package_io.read_text(pkg, path))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise BadInput(path, None, f"not valid YAML{where}: {getattr(err, 'problem', None) or err}")


def load_json(pkg: Path, name: str):
    path = pkg / name
    try:
        return json.loads(package_io.read_text(pkg, path))
    except json.JSONDecodeError as err:
        raise BadInput(path, None, f"not valid JSON: {err}")
    except RecursionError:
        raise BadInput(path, None, "not valid JSON: nested too deep")


def validated(path: Path, data, schema: type[BaseModel]):
    if not isinstance(data, dict):
        raise BadInput(path, None, f"expected a mapping at the top level, got {type(data).__name__}")
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(part) for part in first["loc"]) or None
        got = "" if first["type"] == "missing" else f" (got {_short(first.get('input'))})"
        raise BadInput(path, key, first["msg"] + got)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_spec(pkg: Path, recorded_hash: str) -> ModelSpec:
    path = pkg / "spec.json"
    spec = validated(path, load_json(pkg, "spec.json"), ModelSpec)
    if len(spec.layers) != spec.num_layers:
        raise BadInput(path, "layers", f"lists {len(spec.layers)} layers while num_layers is {spec.num_layers}")
    for position, layer in enumerate(spec.layers):
        if layer.index != position:
            raise BadInput(path, f"layers.{position}.index", f"expected {position}, got {layer.index}")
    if spec.spec_hash() != recorded_hash:
        raise BadInput(path, None, f"hashes to {spec.spec_hash()} while package.yaml spec_hash records "
                                       f"{recorded_hash}: spec.json changed after `onboard new-model`")
    return spec


def read_weight_map(pkg: Path) -> dict[str, dict]:
    weight_map = load_json(pkg, "weight_map.json")
    validated(pkg / "weight_map.json", weight_map, WeightMap)
    return weight_map


def read_source(pkg: Path) -> SourceRecord:
    """package.yaml's `source` alone (where the release is)."""
    return read_manifest_file(pkg).source


def release_folder(pkg: Path, source: SourceRecord, model_dir: Path | None) -> Path:
    """--model-dir, else `source.path` (relative to PKG), else `source.absolute`; its config.json must be
    the one new-model read."""
    manifest_path = pkg / "package.yaml"
    if model_dir is not None:
        folder = Path(model_dir)
        if not folder.is_dir():
            raise BadInput(folder, "--model-dir", "does not exist or is not a folder")
    else:
        tried = [pkg / source.path] + ([Path(source.absolute)] if source.absolute else [])
        folder = next((f for f in tried if f.is_dir()), None)
        if folder is None:
            raise BadInput(manifest_path, "source.path", f"release folder {' or '.join(map(str, tried))} does not "
                                                             "exist (pass --model-dir where the release is now)")
    config = folder / "config.json"
    if not config.is_file():
        raise BadInput(config, None, "missing: the release folder holds no config.json")
    if hashlib.sha256(package_io.read_outside_file(config)).hexdigest() != source.config_sha256:
        raise BadInput(config, None, f"differs from the config new-model read ({manifest_path.name}: "
                                         "source.config_sha256): run `onboard new-model` again for this release")
    return folder.resolve()


def read_vision_config(pkg: Path) -> dict:
    path = pkg / "vision_config.json"
    config = load_json(pkg, "vision_config.json")
    if not isinstance(config, dict):
        raise BadInput(path, None, f"expected a JSON object, got {type(config).__name__}")
    return config
