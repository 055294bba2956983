"""Property: a shard of a real release with a mutated safetensors header, and `onboard inspect`
exits 0, 2 or 3 with no traceback, within 30 s and 2 GiB.

The mutations edit one entry's dtype, shape or offsets (junk or plausible values), rename,
drop or add an entry, flip bytes, or truncate the file; what the header reader accepts then
meets the index check, recognition and the shape check against config.json.
Example count: ONBOARD_FUZZ_EXAMPLES (tests/onboard/conftest.py).
"""
from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

from hypothesis import event, given, settings
from hypothesis import strategies as st

FAMILIES = ("qwen3_moe", "deepseek_v3", "qwen3_next")
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**66), 2**66), st.floats(), st.text(max_size=6),
    st.lists(st.integers(-2, 2**40), max_size=4), st.sampled_from(["F32", "BF16", "F12", "", "I64"]),
    st.lists(st.integers(0, 64), max_size=3),
)


def split(raw: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def mutated(raw: bytes, data) -> bytes:
    header, tensors = split(raw)
    kind = data.draw(st.sampled_from(["field", "rename", "drop", "add", "flip", "truncate"]), label="mutation")
    names = sorted(k for k in header if k != "__metadata__")
    name = data.draw(st.sampled_from(names), label="tensor")
    if kind == "field":
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]), label="field")
        header[name][field] = data.draw(JUNK, label="value")
    elif kind == "rename":
        header[data.draw(st.sampled_from([name + "x", "[/oops]", "a\nb", "\ud800", ""]), label="new name")] = header.pop(name)
    elif kind == "drop":
        header.pop(name)
    elif kind == "add":
        header[data.draw(st.text(max_size=8), label="added")] = data.draw(JUNK, label="entry")
    if kind in ("field", "rename", "drop", "add"):
        return join(header, tensors)
    if kind == "flip":
        out = bytearray(raw)
        for position in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=4), label="positions"):
            out[position] ^= data.draw(st.integers(1, 255), label="mask")
        return bytes(out)
    return raw[:data.draw(st.integers(0, len(raw)), label="cut")]


@settings(settings.get_profile("onboard-fuzz"))
@given(data=st.data())
def test_mutated_shard_header(example_release, release_copy, onboard_cli, data):
    source = example_release(data.draw(st.sampled_from(FAMILIES), label="family"))
    shard = data.draw(st.sampled_from(sorted(p.name for p in source.glob("*.safetensors"))), label="shard")
    raw = mutated((source / shard).read_bytes(), data)
    with tempfile.TemporaryDirectory() as tmp:
        release = release_copy(source, Path(tmp) / "release")
        (release / shard).unlink()  # a hard link to the cached release: replaced, never written into
        (release / shard).write_bytes(raw)
        result = onboard_cli("inspect", release, *data.draw(st.sampled_from([[], ["--json"]]), label="format"))
    event(f"exit {result.code}")
    result.assert_bounded()
