"""read_header against files written by safetensors itself, and against hand-made bad headers.

Every bad header must raise BadInput whose one line names the file and the tensor or key;
where the safetensors library also refuses the file, the test checks that too, so the reader
is never looser than the loader that will read the weights later.
"""
from __future__ import annotations

import io
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from onboard.errors import BadInput
from onboard.release import safetensors_header as header_module
from onboard.release.safetensors_header import MAX_HEADER_BYTES, read_header


def write_raw(path: Path, header: dict | bytes, data_len: int, length: int | None = None) -> Path:
    """A .safetensors file from a header (dict or raw bytes), zeroed data, optional fake length."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    prefix = struct.pack("<Q", len(raw) if length is None else length)
    path.write_bytes(prefix + raw + bytes(data_len))
    return path


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# a: 6 x F32 = 24 bytes at [0, 24); b: 5 x BF16 = 10 bytes at [24, 34)
VALID = {"a": entry("F32", [2, 3], 0, 24), "b": entry("BF16", [5], 24, 34)}
VALID_DATA = 34


def with_entry(name: str, value: object) -> dict:
    return {**VALID, name: value}


def test_reads_what_safetensors_wrote(tmp_path):
    tensors = {
        "w_f32": torch.zeros(3, 5),
        "w_bf16": torch.zeros(7, 9, dtype=torch.bfloat16),
        "idx_i64": torch.zeros(11, dtype=torch.int64),
        "mask_bool": torch.zeros(4, dtype=torch.bool),
        "fp8": torch.zeros(13, dtype=torch.float8_e4m3fn),
        "empty": torch.zeros(0, 63),
        "scalar": torch.tensor(2.0, dtype=torch.float16),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    header = read_header(path)
    assert header.metadata == {"format": "pt"}
    assert set(header.tensors) == set(tensors)
    with safe_open(path, "pt") as f:
        for name, info in header.tensors.items():
            assert list(info.shape) == f.get_slice(name).get_shape(), name
            assert info.dtype == f.get_slice(name).get_dtype(), name
            assert info.nbytes == tensors[name].numel() * tensors[name].element_size(), name


def test_valid_hand_made_file_and_zero_tensor_file(tmp_path):
    header = read_header(write_raw(tmp_path / "ok.safetensors", VALID, VALID_DATA))
    assert header.tensors["b"].shape == (5,) and header.tensors["b"].data_offsets == (24, 34)
    assert header.metadata == {}
    assert read_header(write_raw(tmp_path / "none.safetensors", {}, 0)).tensors == {}


def test_packed_f4_counts_half_bytes(tmp_path):
    path = write_raw(tmp_path / "f4.safetensors", {"q": entry("F4", [3, 4], 0, 6)}, 6)
    assert read_header(path).tensors["q"].nbytes == 6


def test_header_padded_with_spaces_is_fine(tmp_path):
    # the safetensors writer pads the JSON with spaces to an 8-byte boundary
    raw = json.dumps(VALID).encode() + b"   "
    assert set(read_header(write_raw(tmp_path / "pad.safetensors", raw, VALID_DATA)).tensors) == {"a", "b"}


def test_thousands_of_entries_cost_one_pass(tmp_path, monkeypatch):
    """20,000 entries: the file is read for its header only (8 + N bytes, no tensor data), the JSON parsed once and
    each entry checked once. Counted, not timed (a stopwatch bound failed beside another suite);
    bench/bench_safetensors_header.py times it."""
    header = {f"layers.{i}.w": entry("BF16", [4, 4], 32 * i, 32 * (i + 1)) for i in range(20_000)}
    path = write_raw(tmp_path / "big.safetensors", header, 32 * 20_000)
    reads, parses, entries = [], [], []

    class CountingFile(io.FileIO):
        def read(self, size=-1):
            data = super().read(size)
            reads.append(len(data))
            return data

    monkeypatch.setattr(header_module, "open", lambda p, mode: CountingFile(p, "r"), raising=False)
    for name, calls in (("parse_json_object", parses), ("_parse_entry", entries)):
        real = getattr(header_module, name)
        monkeypatch.setattr(header_module, name, lambda *a, _real=real, _calls=calls: _calls.append(1) or _real(*a))
    assert len(read_header(path).tensors) == 20_000
    assert reads == [8, len(json.dumps(header).encode())]
    assert len(parses) == 1 and len(entries) == 20_000


DUPLICATE = (
    b'{"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},'
    b' "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}'
)

# (id, header, data bytes, length prefix override, key the error must name, safetensors also refuses)
BAD_HEADERS = [
    ("length-over-cap", VALID, VALID_DATA, MAX_HEADER_BYTES + 1, "header length", True),
    ("length-beyond-file", VALID, VALID_DATA, 10_000, "header length", True),
    ("not-utf8", b'{"\xff\xfe": 1}', 0, None, None, True),
    ("not-json", b"{this is not json", 0, None, None, True),
    ("utf16-json", '{"a": 1}'.encode("utf-16-le"), 0, None, None, True),
    ("utf8-bom", b'\xef\xbb\xbf{}', 0, None, None, True),
    ("not-an-object", b"[1, 2]", 0, None, None, True),
    ("lone-surrogate-name", b'{"\\ud800": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}', 0, None,
     "\\ud800", True),
    ("duplicate-name", DUPLICATE, 24, None, "a", False),
    ("unknown-dtype", with_entry("b", entry("F12", [5], 24, 34)), VALID_DATA, None, "b", True),
    ("dtype-not-string", with_entry("b", entry(["BF16"], [5], 24, 34)), VALID_DATA, None, "b", True),
    ("negative-dim", with_entry("b", entry("BF16", [-5], 24, 34)), VALID_DATA, None, "b", True),
    ("bool-dim", with_entry("b", entry("BF16", [True, 5], 24, 34)), VALID_DATA, None, "b", True),
    ("string-shape", with_entry("b", entry("BF16", "5", 24, 34)), VALID_DATA, None, "b", True),
    ("offsets-reversed", with_entry("b", entry("BF16", [0], 34, 24)), VALID_DATA, None, "b", True),
    ("three-offsets", with_entry("b", {**entry("BF16", [5], 24, 34), "data_offsets": [24, 30, 34]}),
     VALID_DATA, None, "b", True),
    ("entry-not-object", with_entry("b", [24, 34]), VALID_DATA, None, "b", True),
    ("size-mismatch", with_entry("b", entry("BF16", [6], 24, 34)), VALID_DATA, None, "b", True),
    ("f4-half-byte", {"q": entry("F4", [3], 0, 2)}, 2, None, "q", True),
    ("overlap", with_entry("b", entry("BF16", [5], 20, 30)), 30, None, "b", True),
    ("gap", with_entry("b", entry("BF16", [5], 28, 38)), 38, None, "b", True),
    ("first-not-at-zero", {"a": entry("F32", [2], 8, 16)}, 16, None, "a", True),
    ("trailing-bytes", VALID, VALID_DATA + 3, None, "data_offsets", True),
    ("data-truncated", VALID, VALID_DATA - 4, None, "data_offsets", True),
    ("metadata-not-strings", {**VALID, "__metadata__": {"format": 1}}, VALID_DATA, None,
     "__metadata__.format", True),
]


@pytest.mark.parametrize(
    "header, data_len, length, key, library_refuses",
    [case[1:] for case in BAD_HEADERS],
    ids=[case[0] for case in BAD_HEADERS],
)
def test_bad_header_is_refused_naming_file_and_key(tmp_path, header, data_len, length, key, library_refuses):
    path = write_raw(tmp_path / "bad.safetensors", header, data_len, length)
    with pytest.raises(BadInput) as info:
        read_header(path)
    line = info.value.one_line()
    assert "\n" not in line and line.startswith(str(path))
    if key is not None:
        assert info.value.key == key and f": {key}: " in line
    if library_refuses:
        with pytest.raises(Exception):
            safe_open(path, "pt")


def test_file_shorter_than_length_prefix(tmp_path):
    path = tmp_path / "stub.safetensors"
    path.write_bytes(b"\x01\x02\x03")
    with pytest.raises(BadInput, match="header length"):
        read_header(path)


def test_huge_sparse_file_is_read_without_touching_its_data(tmp_path):
    size = 64 << 30
    path = write_raw(tmp_path / "huge.safetensors", {"w": entry("U8", [size], 0, size)}, 0)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size + size)
    assert read_header(path).tensors["w"].nbytes == size


def test_fifo_is_refused_instead_of_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe.safetensors")
    with pytest.raises(BadInput, match="not a regular file"):
        read_header(tmp_path / "pipe.safetensors")


def test_missing_file_is_an_onboard_error(tmp_path):
    with pytest.raises(BadInput, match="nothing.safetensors"):
        read_header(tmp_path / "nothing.safetensors")
