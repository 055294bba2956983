"""Fuzz read_header with mutated copies of a valid safetensors file.

Each mutation must be either read correctly or refused with BadInput: any other exception,
or a read slower than the deadline, fails. "Read correctly" is checked against the safetensors
library: whatever we accept, it must accept too, with the same names, shapes and dtypes.
"""
from __future__ import annotations

import json
import struct
from functools import cache
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from onboard.errors import BadInput
from onboard.release.safetensors_header import DTYPE_BITS, read_header

FUZZ = settings(
    max_examples=150,
    deadline=1000,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
U64_MAX = 2**64 - 1


@cache
def valid_file_bytes() -> bytes:
    """A small valid file written by safetensors: several dtypes, an empty tensor, metadata."""
    import tempfile

    tensors = {
        "a": torch.zeros(3, 5),
        "b": torch.zeros(7, dtype=torch.bfloat16),
        "c": torch.zeros(2, 2, dtype=torch.int64),
        "d": torch.zeros(3, dtype=torch.bool),
        "e": torch.zeros(0, 4),
        "f": torch.zeros(5, dtype=torch.uint8),
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "valid.safetensors"
        save_file(tensors, path, metadata={"format": "pt"})
        return path.read_bytes()


def split(raw: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def join(header: dict | str, data: bytes, length_delta: int = 0) -> bytes:
    text = header if isinstance(header, str) else json.dumps(header)
    raw = text.encode()
    return struct.pack("<Q", min(max(len(raw) + length_delta, 0), U64_MAX)) + raw + data


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "mutant.safetensors"


def check_read(path: Path, raw: bytes) -> bool:
    """The property: accepted files are what safetensors sees; the rest is BadInput."""
    path.write_bytes(raw)
    try:
        header = read_header(path)
    except BadInput as exc:
        assert "\n" not in exc.one_line() and str(path) in exc.one_line()
        return False
    with safe_open(path, "pt") as f:
        assert set(f.keys()) == set(header.tensors)
        for name, info in header.tensors.items():
            assert list(info.shape) == f.get_slice(name).get_shape()
            assert info.dtype == f.get_slice(name).get_dtype()
    return True


def fuzz_read(path: Path, raw: bytes) -> None:
    event("accepted" if check_read(path, raw) else "refused")


def test_unmutated_file_is_accepted(target):
    assert check_read(target, valid_file_bytes())
    assert len(read_header(target).tensors) == 6


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=4))
def test_byte_flips(target, flips):
    raw = bytearray(valid_file_bytes())
    for position, mask in flips:
        raw[position % len(raw)] ^= mask
    fuzz_read(target, bytes(raw))


@FUZZ
@given(cut=st.integers(0, 10_000), extra=st.binary(max_size=16))
def test_truncated_or_extended(target, cut, extra):
    raw = valid_file_bytes()
    fuzz_read(target, raw[: cut % (len(raw) + 1)] + extra)


JUNK = st.one_of(
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.none(),
    st.lists(st.one_of(st.integers(-3, 2**66), st.booleans(), st.floats()), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
DTYPES = st.sampled_from([*DTYPE_BITS, "F12", "bf16", "", "FLOAT32"])
SHAPES = st.lists(st.integers(0, 20), max_size=4)
OFFSETS = st.lists(st.integers(0, 300), min_size=2, max_size=2)


@st.composite
def json_edits(draw) -> tuple[dict, int]:
    """Replace one field of one tensor (or the metadata) with a plausible or junk value."""
    header, _ = split(valid_file_bytes())
    name = draw(st.sampled_from(sorted(header)))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "<entry>", "<drop>"]))
    value = draw(st.one_of(JUNK, DTYPES, SHAPES, OFFSETS))
    if field == "<entry>":
        header[name] = value
    elif field == "<drop>":
        header.pop(name)
    elif isinstance(header[name], dict) and name != "__metadata__":
        header[name][field] = value
    else:
        header[name] = {field: value}
    return header, draw(st.sampled_from([0, 0, 0, -1, 1, -8, 8]))


@FUZZ
@given(edit=json_edits())
def test_json_edits_of_dtype_shape_offsets(target, edit):
    header, length_delta = edit
    fuzz_read(target, join(header, split(valid_file_bytes())[1], length_delta))


@FUZZ
@given(length=st.one_of(st.none(), st.integers(0, U64_MAX), st.integers(0, 400)), dup=st.booleans())
def test_length_prefix_and_duplicate_names(target, length, dup):
    header, data = split(valid_file_bytes())
    text = json.dumps(header)
    if dup:
        # same name twice in the JSON text; json.dumps of a dict cannot produce that
        empty_a = '"a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}'
        text = text.replace('{"__metadata__"', "{" + empty_a + ', "__metadata__"')
        assert text.count('"a":') == 2
    raw = join(text, data)
    # None keeps the true length, so the duplicate alone decides
    fuzz_read(target, raw if length is None else struct.pack("<Q", length) + raw[8:])


@pytest.mark.parametrize("shape", [[5, 3], [15], [1, 15, 1]], ids=["transposed", "flat", "padded-ones"])
def test_equal_size_reshape_is_accepted(target, shape):
    header, data = split(valid_file_bytes())
    header["a"]["shape"] = shape
    assert check_read(target, join(header, data))
    assert read_header(target).tensors["a"].shape == tuple(shape)
