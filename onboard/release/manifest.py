"""What a released model folder holds: its config and its tensors, validated, without tensor data.

MODEL_DIR has config.json and either model.safetensors.index.json (+ the shards it names) or a
single model.safetensors. The index alone is enough (shapes then unknown); when shards are
present their headers are read and must agree with the index in both directions.

A release that ships quantized weights (quantization_config, onboard/release/quantization.py) is presented in its
logical view: each quantized weight under the name and shape a bf16 release of the family gives it, its scale
tensors hidden; `stored` says, per logical name, which released tensors hold its codes and scales.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Optional

from onboard.errors import BadInput, printable
from onboard.release.config_checks import check_config, check_counts_against_tensors
from onboard.release.quantization import PACKED_SHAPE, QuantizedRelease, logical_dtype, read_quantization
from onboard.release.safetensors_header import DTYPE_BITS, parse_json_object, read_header
from runtime.formats.scheme import StoredEntry

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
VISION_CONFIG_KEYS = ("vision_config", "vit_config", "visual")
# Real configs are a few KB (the largest of transformers' default configs is 10 KB; an image
# classifier's 21k labels make about 1 MB). The flagship's index (157k tensors) is 16 MB; 64 MB
# holds about 600k tensors and still parses in well under the 2 GiB this tool may use.
MAX_CONFIG_BYTES = 4 << 20
MAX_INDEX_BYTES = 64 << 20

# Bytes per element of the config's torch_dtype, to count parameters from the index's byte total.
DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}


# A NamedTuple rather than a frozen dataclass: built once per tensor (157k for the flagship),
# at half the cost
class TensorInfo(NamedTuple):
    name: str
    # None when only the index is on disk (shapes and dtypes live in the shard headers)
    dtype: str | None
    shape: tuple[int, ...] | None
    file: str


@dataclass(frozen=True)
class Manifest:
    root: Path
    config: dict
    text_config: dict
    vision_config: dict | None
    tensors: dict[str, TensorInfo]
    shard_files: tuple[str, ...]
    total_bytes: int
    shards_present: bool
    # the release's quantization_config as read and checked against its tensors; None when it ships unquantized
    quantization: Optional[QuantizedRelease] = None
    # the tensors as released (scales included) when quantized, else the same dict as `tensors`
    released: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def stored(self) -> dict[str, StoredEntry]:
        """Logical name -> its codes and scale tensors, for every weight the release stores quantized."""
        return self.quantization.stored if self.quantization else {}

    @functools.cached_property
    def stored_bytes(self) -> dict[str, int]:
        """Logical name -> bytes its released tensors (codes, scales, a packed weight's shape) hold on disk; {}
        from the index alone."""
        if not self.shards_present or self.quantization is None:
            return {}
        out = {}
        for logical, entry in self.stored.items():
            shape = entry.codes.rsplit(".", 1)[0] + PACKED_SHAPE
            # compressed-tensors' mxfp4 pack may carry no weight_shape (Kimi K3's does not): counted where stored
            companions = (entry.codes, entry.scale) + ((shape,) if shape in self.released else ())
            out[logical] = sum(_nbytes(self.released[n]) for n in companions)
        return out

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    @property
    def total_params(self) -> Optional[int]:
        """Exact from (logical) shapes when shards are present; else total_bytes / bytes of torch_dtype, which a
        quantized release's bytes do not give (None)."""
        if self.shards_present:
            return sum(math.prod(info.shape) for info in self.tensors.values())
        if self.quantization is not None:
            return None
        return self.total_bytes // self._bytes_per_element()

    def _bytes_per_element(self) -> int:
        # transformers 5 writes "dtype", older releases "torch_dtype"
        for part in (self.config, self.text_config):
            name = part.get("dtype") or part.get("torch_dtype")
            if name in DTYPE_BYTES:
                return DTYPE_BYTES[name]
        raise BadInput(self.root / CONFIG_NAME, "torch_dtype", "needed to count parameters from the index alone; "
                           f"expected one of {', '.join(DTYPE_BYTES)}")


def read_manifest(model_dir: str | Path) -> Manifest:
    """Read and validate MODEL_DIR; every problem raises BadInput naming the file and key."""
    root = Path(model_dir)
    if not _encodes(str(root.absolute())):
        # the path goes into every report and package file, all of them UTF-8 text
        raise BadInput(root, None, "the folder's path is not valid UTF-8; rename or link it under a UTF-8 name")
    if not _exists(root):
        raise BadInput(root, None, "does not exist; expected a folder with config.json and safetensors weights")
    if not root.is_dir():
        raise BadInput(root, None, "not a directory; expected a folder with config.json and safetensors weights")
    try:
        config = read_config(root)
        weights = _read_weights(root)
    # a folder or file the user cannot read (permissions, I/O errors): the input, not a bug
    except OSError as exc:
        raise BadInput(exc.filename or root, None, f"cannot be read ({exc.strerror or exc})") from None
    text_config = _sub_config(config, TEXT_CONFIG_KEYS, root)
    vision_config = _sub_config(config, VISION_CONFIG_KEYS, root)
    text_config = config if text_config is None else text_config
    quantized = read_quantization(config, text_config, weights.tensors, root / CONFIG_NAME)
    tensors = logical_view(weights.tensors, quantized, logical_dtype(config, text_config))
    check_counts_against_tensors(config, list(tensors), root / CONFIG_NAME)
    return Manifest(root, config, text_config, vision_config, tensors, weights.shard_files, weights.total_bytes,
                    weights.shards_present, quantized, weights.tensors)


def logical_view(released: dict[str, TensorInfo], quantized: Optional[QuantizedRelease],
                 dtype: str) -> dict[str, TensorInfo]:
    """The tensors as a bf16 release of the family names and shapes them: each quantized weight's codes under its
    logical name, its scales dropped; the released tensors themselves when nothing is quantized."""
    if quantized is None:
        return released
    logical_of = {entry.codes: name for name, entry in quantized.stored.items()}
    out = {}
    for name, info in released.items():
        if name in logical_of:
            logical = logical_of[name]
            out[logical] = TensorInfo(logical, dtype if info.dtype else None, quantized.logical_shapes.get(logical),
                                      info.file)
        elif name not in quantized.hidden:
            out[name] = info
    return out


def _nbytes(info: TensorInfo) -> int:
    return math.prod(info.shape) * DTYPE_BITS[info.dtype] // 8


def _exists(path: Path) -> bool:
    try:
        return path.exists() or path.is_symlink()
    except OSError:  # a name too long, a symlink loop: not a folder we can read
        return False


def read_config(root: Path) -> dict:
    """config.json of MODEL_DIR as a dict, with its values checked."""
    path = root / CONFIG_NAME
    if not _exists(path):
        raise BadInput(path, None, "missing; a released model folder needs config.json")
    config = parse_json_object(_read_small_file(root, CONFIG_NAME, MAX_CONFIG_BYTES), path, CONFIG_NAME)
    check_config(config, path)
    return config


def _read_small_file(root: Path, name: str, limit: int) -> bytes:
    """A JSON file of the release: same symlink rule as the shards, size capped before reading."""
    path = root / name
    problem = _shard_problem(name, root)
    if problem:
        raise BadInput(path, None, problem)
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise BadInput(path, None, f"cannot be read ({exc.strerror or exc})") from None
    if len(raw) > limit:
        raise BadInput(path, None, f"larger than {limit >> 20} MB; no real release has a {name} that size")
    return raw


def _sub_config(config: dict, keys: tuple[str, ...], root: Path) -> dict | None:
    for key in keys:
        if key in config and config[key] is not None:
            if not isinstance(config[key], dict):
                raise BadInput(root / CONFIG_NAME, key, f"must be an object, got {type(config[key]).__name__}")
            return config[key]
    return None


@dataclass(frozen=True)
class _Weights:
    tensors: dict[str, TensorInfo]
    shard_files: tuple[str, ...]
    total_bytes: int
    shards_present: bool


def _read_weights(root: Path) -> _Weights:
    has_index = (root / INDEX_NAME).is_file()
    has_single = (root / SINGLE_NAME).is_file()
    if has_index and has_single:
        raise BadInput(root, INDEX_NAME, f"both {SINGLE_NAME} and {INDEX_NAME} exist; keep one")
    if has_single:
        problem = _shard_problem(SINGLE_NAME, root)
        if problem:
            raise BadInput(root / SINGLE_NAME, None, problem)
        return _read_single_file(root)
    if has_index:
        return _read_index(root)
    raise BadInput(root, None, f"no {INDEX_NAME} or {SINGLE_NAME}; only safetensors releases are supported")


def _read_single_file(root: Path) -> _Weights:
    header = read_header(root / SINGLE_NAME)
    tensors = {
        name: TensorInfo(name, info.dtype, info.shape, SINGLE_NAME) for name, info in header.tensors.items()
    }
    total_bytes = sum(info.nbytes for info in header.tensors.values())
    return _Weights(tensors, (SINGLE_NAME,), total_bytes, True)


def _read_index(root: Path) -> _Weights:
    index_path = root / INDEX_NAME
    index = parse_json_object(_read_small_file(root, INDEX_NAME, MAX_INDEX_BYTES), index_path, INDEX_NAME)
    weight_map = _weight_map(index, index_path)
    shard_files = tuple(sorted(set(weight_map.values())))
    for file in shard_files:
        _check_shard_name(file, root, index_path, weight_map)
    missing = [file for file in shard_files if not (root / file).exists()]
    if len(missing) == len(shard_files):
        tensors = {name: TensorInfo(name, None, None, file) for name, file in weight_map.items()}
        return _Weights(tensors, shard_files, _index_total_size(index, index_path), False)
    if missing:
        raise BadInput(index_path, missing[0], f"shard missing from the folder ({len(missing)} of "
                           f"{len(shard_files)} missing); all shards or none must be present")
    return _read_shards(root, weight_map, shard_files)


def _weight_map(index: dict, index_path: Path) -> dict[str, str]:
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise BadInput(index_path, "weight_map", "must be a non-empty object of tensor name -> shard file")
    # one pass in C: this map has 157k entries for the flagship
    if set(map(type, weight_map.values())) != {str}:
        name = next(name for name, file in weight_map.items() if not isinstance(file, str))
        raise BadInput(index_path, f"weight_map.{name}", "shard file must be a string")
    _check_unicode(weight_map, index_path)
    return weight_map


def _check_unicode(weight_map: dict[str, str], index_path: Path) -> None:
    # Python keeps lone surrogates from JSON escapes ("\ud800"); no file system or safetensors
    # loader takes them. One joined encode is a C pass over the whole map.
    try:
        "".join(weight_map).encode()
        "".join(set(weight_map.values())).encode()
    except UnicodeEncodeError:
        bad = next(n for n, f in weight_map.items() if not (_encodes(n) and _encodes(f)))
        raise BadInput(index_path, f"weight_map.{printable(bad)}", "not valid Unicode (lone surrogate escape)") from None


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _check_shard_name(file: str, root: Path, index_path: Path, weight_map: dict[str, str]) -> None:
    problem = _shard_problem(file, root)
    if problem:
        name = next(name for name, shard in weight_map.items() if shard == file)
        raise BadInput(index_path, f"weight_map.{name}", f"shard {file!r} {problem}")


def _shard_problem(file: str, root: Path) -> str | None:
    """A weight file must be a plain file name that stays inside MODEL_DIR, symlinks included."""
    path = root / file
    if file in ("", ".", "..") or any(sep in file for sep in ("/", "\\", "\0")):
        return "must be a plain file name inside the model folder"
    try:
        if path.is_symlink() and not _inside_release(root, path.resolve(strict=True)):
            return f"is a symlink resolving outside the model folder ({printable(str(path.resolve()))})"
        if path.exists() and not path.is_file():
            return "is not a regular file"
    # a symlink loop, a dangling link, a name longer than the file system takes
    except (OSError, RuntimeError) as exc:
        return f"cannot be resolved ({getattr(exc, 'strerror', None) or exc})"
    return None


def _inside_release(root: Path, target: Path) -> bool:
    # A Hugging Face hub snapshot (hub/models--org--name/snapshots/REV) links each file to
    # ../../blobs/HASH of the same repository folder; that is still the release.
    snapshot = root.resolve()
    allowed = {snapshot}
    if snapshot.parent.name == "snapshots":
        allowed.add(snapshot.parent.parent / "blobs")
    return target.parent in allowed


def _index_total_size(index: dict, index_path: Path) -> int:
    metadata = index.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if type(total) is not int or total < 0:
        raise BadInput(index_path, "metadata.total_size", "must be a non-negative integer byte count "
                           f"when the shards are absent, got {total!r:.40}")
    return total


def _read_shards(root: Path, weight_map: dict[str, str], shard_files: tuple[str, ...]) -> _Weights:
    headers = {file: read_header(root / file).tensors for file in shard_files}
    _check_index_matches_headers(root, weight_map, headers)
    tensors = {}
    for name, file in weight_map.items():
        info = headers[file][name]
        tensors[name] = TensorInfo(name, info.dtype, info.shape, file)
    total_bytes = sum(info.nbytes for header in headers.values() for info in header.values())
    return _Weights(tensors, shard_files, total_bytes, True)


def _check_index_matches_headers(root: Path, weight_map: dict[str, str], headers: dict) -> None:
    for name, file in weight_map.items():
        if name not in headers[file]:
            raise BadInput(root / file, name, f"listed in {INDEX_NAME} for this shard but absent from its header")
    for file, header in headers.items():
        for name in header:
            if weight_map.get(name) != file:
                placed = f"placed in {weight_map[name]}" if name in weight_map else "not listed"
                raise BadInput(root / file, name, f"in this shard's header but {placed} in {INDEX_NAME}")
