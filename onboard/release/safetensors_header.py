"""Read and validate the JSON header of a .safetensors file, never its tensor data.

File layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the data buffer.
The checks follow the safetensors library's own loader, so a file that passes here is one
`safetensors.safe_open` accepts, and every failure names the file and the tensor or key.
"""
from __future__ import annotations

import json
import os
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from onboard.errors import BadInput, printable

# The safetensors library refuses headers above this size (its MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000
# Tensors in one file. The whole 2.8T flagship has 157k; real shards hold hundreds to a few
# thousand. Counted in the raw bytes before parsing, so a header of a million empty tensors
# costs one scan instead of a million objects.
MAX_TENSORS_PER_FILE = 200_000

# Bits per element of every dtype the safetensors format defines (F4/F6 are packed sub-byte).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

METADATA_KEY = "__metadata__"


@dataclass(frozen=True, slots=True)
class TensorHeader:
    dtype: str
    shape: tuple[int, ...]
    # byte range [begin, end) relative to the start of the data buffer
    data_offsets: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, TensorHeader]
    metadata: dict[str, str]


def parse_json_object(raw: bytes, path: str | Path, what: str = "file") -> dict:
    """Parse UTF-8 JSON that must be an object; duplicate keys at any level are an error."""
    try:
        # decoded here because json.loads(bytes) would also take UTF-16/32, which
        # safetensors and transformers refuse
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(path, None, f"{what} is not valid UTF-8 ({exc.reason})") from None
    try:
        value = json.loads(text, object_pairs_hook=_pairs_without_duplicates(path))
    # RecursionError: absurdly nested arrays; ValueError covers JSONDecodeError and huge ints
    except (ValueError, RecursionError) as exc:
        raise BadInput(path, None, f"{what} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise BadInput(path, None, f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _pairs_without_duplicates(path: str | Path):
    def build(pairs: list[tuple[str, object]]) -> dict:
        result = dict(pairs)
        if len(result) != len(pairs):
            duplicate = next(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
            raise BadInput(path, printable(duplicate), "duplicate key in JSON object")
        return result

    return build


def read_header(path: str | Path) -> SafetensorsHeader:
    """Read and validate the header of one .safetensors file (reads 8 + N bytes only)."""
    path = Path(path)
    # checked before open(): opening a FIFO would block forever
    if not path.is_file():
        raise BadInput(path, None, "missing or not a regular file")
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            header_len = _read_header_length(f, path, file_size)
            raw = f.read(header_len)
    except OSError as exc:
        raise BadInput(path, None, f"cannot read safetensors file ({exc.strerror or exc})") from None
    if len(raw) != header_len:
        raise BadInput(path, "header length", "file shrank while reading its header")
    # every entry names its data_offsets: an upper bound on the count, in one C-level scan
    if raw.count(b'"data_offsets"') > MAX_TENSORS_PER_FILE:
        raise BadInput(path, None, f"header lists more than {MAX_TENSORS_PER_FILE} tensors; no real release has that many in one file")
    parsed = parse_json_object(raw, path, "safetensors header")
    _check_encodable(parsed, path)
    metadata = _validate_metadata(parsed.pop(METADATA_KEY, None), path)
    tensors = {name: _parse_entry(name, entry, path) for name, entry in parsed.items()}
    _validate_layout(tensors, file_size - 8 - header_len, path)
    return SafetensorsHeader(tensors, metadata)


def _read_header_length(f, path: Path, file_size: int) -> int:
    prefix = f.read(8)
    if len(prefix) != 8:
        raise BadInput(path, "header length", f"file has {file_size} bytes, fewer than the 8-byte length prefix")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES:
        raise BadInput(path, "header length", f"{header_len} bytes exceeds the {MAX_HEADER_BYTES}-byte cap")
    if 8 + header_len > file_size:
        raise BadInput(path, "header length", f"{header_len} bytes runs past the end of the {file_size}-byte file")
    return header_len


def _check_encodable(parsed: dict, path: Path) -> None:
    # Python keeps lone surrogates from JSON escapes; the safetensors loader refuses them.
    metadata = parsed.get(METADATA_KEY)
    pairs = metadata.items() if isinstance(metadata, dict) else ()
    for text in [*parsed, *(s for pair in pairs for s in pair if isinstance(s, str))]:
        if not text.isascii() and any(0xD800 <= ord(ch) <= 0xDFFF for ch in text):
            raise BadInput(path, printable(text), "not valid Unicode (lone surrogate escape)")


def _validate_metadata(metadata: object, path: Path) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise BadInput(path, METADATA_KEY, f"must be an object of strings, got {type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise BadInput(path, f"{METADATA_KEY}.{key}", f"must be a string, got {type(value).__name__}")
    return metadata


def _parse_entry(name: str, entry: object, path: Path) -> TensorHeader:
    if not isinstance(entry, dict):
        raise BadInput(path, name, f"entry must be an object, got {type(entry).__name__}")
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise BadInput(path, name, f"unknown dtype {dtype!r:.40}; expected one of {', '.join(DTYPE_BITS)}")
    shape = _int_list(entry.get("shape"), name, "shape", path)
    offsets = _int_list(entry.get("data_offsets"), name, "data_offsets", path)
    if len(offsets) != 2 or offsets[0] > offsets[1]:
        raise BadInput(path, name, f"data_offsets must be [begin, end] with begin <= end, got {offsets!r:.80}")
    _check_size(name, dtype, shape, offsets, path)
    return TensorHeader(dtype, tuple(shape), (offsets[0], offsets[1]))


def _int_list(value: object, name: str, field: str, path: Path) -> list[int]:
    # type() rather than isinstance: bool is an int subclass but never a size. Two C-level
    # passes instead of a generator: this runs twice per tensor of every shard.
    if type(value) is not list or (value and (set(map(type, value)) != {int} or min(value) < 0)):
        raise BadInput(path, name, f"{field} must be a list of non-negative integers, got {value!r:.80}")
    return value


def _check_size(name: str, dtype: str, shape: list[int], offsets: list[int], path: Path) -> None:
    span = offsets[1] - offsets[0]
    limit = 8 * span
    count = _element_count(shape, limit)
    bits = count * DTYPE_BITS[dtype]
    if count <= limit and bits % 8:
        raise BadInput(path, name, f"{dtype} shape {shape!r:.80} does not fill whole bytes")
    if bits != 8 * span:
        needed = f"{bits // 8} bytes" if count <= limit else f"more than {span} bytes"
        message = f"data_offsets {offsets} span {span} bytes, {dtype} {shape!r:.80} needs {needed}"
        raise BadInput(path, name, message)


def _element_count(shape: list[int], limit: int) -> int:
    """Product of shape, cut off just above limit: a hostile shape of huge dims stays cheap."""
    if 0 in shape:
        return 0
    count = 1
    for dim in shape:
        count *= dim
        if count > limit:
            return limit + 1
    return count


def _validate_layout(tensors: dict[str, TensorHeader], data_size: int, path: Path) -> None:
    """Byte ranges must tile [0, data_size) exactly: no gap, no overlap, no trailing bytes."""
    end = 0
    for name, info in sorted(tensors.items(), key=lambda item: item[1].data_offsets):
        begin = info.data_offsets[0]
        if begin != end:
            problem = "overlaps the previous tensor" if begin < end else f"leaves a gap after byte {end}"
            raise BadInput(path, name, f"data_offsets {list(info.data_offsets)} {problem}")
        end = info.data_offsets[1]
    if end != data_size:
        where = "beyond the end of the file" if end > data_size else f"leaving {data_size - end} trailing bytes"
        raise BadInput(path, "data_offsets", f"tensors cover {end} data bytes, file holds {data_size}: {where}")
