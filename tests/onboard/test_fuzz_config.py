"""Property: any JSON value at any key of a known family's config.json, and `onboard inspect`
exits 0, 2 or 3 with no traceback, within 30 s and 2 GiB.

The releases are the example families (real transformers save_pretrained). Each example picks
a family, a key path anywhere in its config (list items too) and replaces, deletes or adds a
value. Example count: ONBOARD_FUZZ_EXAMPLES (tests/onboard/conftest.py).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import event, given, settings
from hypothesis import strategies as st

from onboard.example_models import FAMILIES

SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([0, 1, -1, 2, 3, 7, 64, 1 << 24, (1 << 24) + 1, 1 << 31, 1 << 63, -(1 << 40)]),
    st.integers(-(2**70), 2**70),
    # Python's json writes and reads NaN and Infinity; transformers reads them too
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "1", "abc", "silu", "bfloat16", "[/oops]", "\n", "\ud800", "full_attention", "sparse"]),
    st.text(max_size=8),
)
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def key_paths(value, path=()) -> list[tuple]:
    """Every key path into a config: dict keys and list indices, at every depth."""
    paths = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        paths.append((*path, key))
        paths += key_paths(child, (*path, key))
    return paths


def mutate(config: dict, path: tuple, operation: str, value, new_key: str) -> None:
    parent = config
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if operation == "delete" and isinstance(parent, dict):
        del parent[last]
    elif operation == "add" and isinstance(parent, dict):
        parent[new_key] = value
    else:
        parent[last] = value


@settings(settings.get_profile("onboard-fuzz"))
@given(data=st.data())
def test_any_value_at_any_key(example_release, release_copy, onboard_cli, data):
    family = data.draw(st.sampled_from(FAMILIES), label="family")
    source = example_release(family)
    config = json.loads((source / "config.json").read_text())
    path = data.draw(st.sampled_from(key_paths(config)), label="path")
    operation = data.draw(st.sampled_from(["replace", "replace", "delete", "add"]), label="operation")
    mutate(config, path, operation, data.draw(JSON_VALUES, label="value"), data.draw(st.text(max_size=8), label="key"))
    fmt = data.draw(st.sampled_from([[], ["--json"], ["--markdown"]]), label="format")
    with tempfile.TemporaryDirectory() as tmp:
        release = release_copy(source, Path(tmp) / "release")
        (release / "config.json").write_text(json.dumps(config))
        result = onboard_cli("inspect", release, *fmt)
    event(f"exit {result.code}")
    result.assert_bounded()



def test_a_list_for_the_image_token_id_is_bad_input_not_a_crash(example_release, release_copy, onboard_cli, tmp_path):
    """Found by the property above (qwen3_5_moe, image_token_id = []): recognition handed the list to VisionSpec
    unchecked, a validation error (exit 1 with a trace). Now it is read as an integer, and transformers' config class
    then refuses the list: exit 2, one line naming the file and the key."""
    source = example_release("qwen3_5_moe")
    config = json.loads((source / "config.json").read_text())
    mutate(config, ("image_token_id",), "replace", [], "")
    release = release_copy(source, tmp_path / "release")
    (release / "config.json").write_text(json.dumps(config))
    result = onboard_cli("inspect", release)
    result.assert_bounded()
    assert result.code == 2 and "config.json" in result.err and "image_token_id" in result.err
    assert len(result.err.strip().splitlines()) == 1
