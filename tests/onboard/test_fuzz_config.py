"""Property: any JSON value at any key of a known family's config.json, and `onboard inspect`
(and `onboard new-model`, the whole graph) exits 0, 2 or 3 with no traceback, within 30 s and 2 GiB.

The releases are the example families (real transformers save_pretrained). Each example picks
a family, a key path anywhere in its config (list items too) and replaces, deletes or adds a
value, or drops an item from a list (a per-layer list one entry short). Values include 1 MB
strings and long lists. Example count: ONBOARD_FUZZ_EXAMPLES (tests/onboard/conftest.py);
new-model runs a fifth of it (at least 1), each run aligning tiers 0-2.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from hypothesis import event, given, settings, strategies as st

from onboard.examples.models import FAMILIES

SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([0, 1, -1, 2, 3, 7, 64, 1 << 24, (1 << 24) + 1, 1 << 31, 1 << 63, -(1 << 40)]),
    st.integers(-(2**70), 2**70),
    # Python's json writes and reads NaN and Infinity; transformers reads them too
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "1", "abc", "silu", "bfloat16", "[/oops]", "\n", "\ud800", "full_attention", "sparse"]),
    st.text(max_size=8),
    # sizes no config has: a 1 MB string hung `inspect` (rich's highlighter), a long list of layers
    st.sampled_from(["x" * (1 << 20), "A" * 5000]),
)
LONG_LISTS = st.sampled_from([["sparse"] * 10_000, list(range(5000))])
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
) | LONG_LISTS
OPERATIONS = ["replace", "replace", "delete", "add", "shorten"]


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
    elif operation == "shorten" and isinstance(parent[last], list) and parent[last]:
        parent[last] = parent[last][:-1]
    elif operation == "shorten" and isinstance(parent, list):
        del parent[last]
    else:
        parent[last] = value


def mutated_release(data, example_release, release_copy, target: Path) -> Path:
    """A copy of an example family's release with one drawn mutation of its config.json."""
    family = data.draw(st.sampled_from(FAMILIES), label="family")
    source = example_release(family)
    config = json.loads((source / "config.json").read_text())
    path = data.draw(st.sampled_from(key_paths(config)), label="path")
    operation = data.draw(st.sampled_from(OPERATIONS), label="operation")
    mutate(config, path, operation, data.draw(JSON_VALUES, label="value"), data.draw(st.text(max_size=8), label="key"))
    release = release_copy(source, target)
    (release / "config.json").write_text(json.dumps(config))
    return release


@settings(settings.get_profile("onboard-fuzz"))
@given(data=st.data())
def test_any_value_at_any_key(example_release, release_copy, onboard_cli, data):
    fmt = data.draw(st.sampled_from([[], ["--json"], ["--markdown"]]), label="format")
    with tempfile.TemporaryDirectory() as tmp:
        release = mutated_release(data, example_release, release_copy, Path(tmp) / "release")
        result = onboard_cli("inspect", release, *fmt)
    event(f"exit {result.code}")
    result.assert_bounded()


# the done-when: ONBOARD_FUZZ_EXAMPLES=500 runs 500 through inspect and 100 through new-model
NEW_MODEL_EXAMPLES = max(1, settings.get_profile("onboard-fuzz").max_examples // 5)
# tiers 0-2 of a tiny release take about a minute of CPU; a spinning hang is far above
NEW_MODEL_CPU_LIMIT_S = 600.0


@settings(settings.get_profile("onboard-fuzz"), max_examples=NEW_MODEL_EXAMPLES)
@given(data=st.data())
def test_any_value_at_any_key_through_new_model(example_release, release_copy, onboard_cli, data):
    """The whole graph (package, generation, alignment tiers 0-2) on a mutated release: 0, 2 or 3, never a bug.
    Alignment runs the release through transformers too, so its CPU bound is the graph's, not inspect's."""
    with tempfile.TemporaryDirectory() as tmp:
        release = mutated_release(data, example_release, release_copy, Path(tmp) / "release")
        result = onboard_cli("new-model", release, "--out", Path(tmp) / "pkg")
    event(f"exit {result.code}")
    assert result.code in (0, 2, 3), (result.code, result.err[-2000:])
    assert "Traceback" not in result.err and "Traceback" not in result.out, result.err[-2000:]
    # the graph prints its progress on stderr first; the error is its last line, alone
    if result.code == 2:
        assert result.err.strip().splitlines()[-1].startswith("onboard: error: "), result.err[-2000:]
    assert result.cpu_seconds < NEW_MODEL_CPU_LIMIT_S, result.cpu_seconds



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


def _inspect_edited(example_release, release_copy, onboard_cli, tmp_path, family: str, edit, *args):
    source = example_release(family)
    config = json.loads((source / "config.json").read_text())
    edit(config)
    release = release_copy(source, tmp_path / "release")
    (release / "config.json").write_text(json.dumps(config))
    result = onboard_cli("inspect", release, *args)
    result.assert_bounded()
    return result


def _one_line_naming(result, key: str) -> bool:
    return (result.code == 2 and len(result.err.strip().splitlines()) == 1
            and "config.json: " + key in result.err)


def test_an_mlp_layer_types_shorter_than_the_layers_is_bad_input(example_release, release_copy, onboard_cli, tmp_path):
    """Found by the property (kimi_linear, one entry dropped from mlp_layer_types): recognition indexed the list by
    layer, an IndexError (exit 1). The file contradicts its own num_hidden_layers: exit 2 naming the key."""
    def edit(config):
        config["mlp_layer_types"] = config["mlp_layer_types"][:-1]
    result = _inspect_edited(example_release, release_copy, onboard_cli, tmp_path, "kimi_linear", edit)
    assert _one_line_naming(result, "mlp_layer_types: has 3 entries but num_hidden_layers is 4"), result.err


@pytest.mark.parametrize("key", ["model_type", "architectures", "hidden_act", "<key>"])
def test_a_1mb_string_is_bad_input_at_once(example_release, release_copy, onboard_cli, tmp_path, key):
    """Found by the issue's probe: a 1 MB model_type or architectures entry hung `inspect` (rich's repr highlighter
    matched its regexes over the printed name, quadratic in its length). Now any config string over 4 KiB is exit 2
    before anything reads it, and the terminal report is printed without automatic highlighting."""
    big = "x" * (1 << 20)

    def edit(config):
        if key == "<key>":
            config[big] = 1
        else:
            config[key] = [big] if key == "architectures" else big
    result = _inspect_edited(example_release, release_copy, onboard_cli, tmp_path, "qwen3_next", edit)
    shown = {"architectures": "architectures[0]", "<key>": "x" * 40 + "...(1048576 characters)"}.get(key, key)
    assert _one_line_naming(result, f"{shown}: ") and "a string of 1048576 characters" in result.err, result.err
    assert result.cpu_seconds < 5, result.cpu_seconds


def test_a_list_far_longer_than_the_layers_is_bad_input(example_release, release_copy, onboard_cli, tmp_path):
    def edit(config):
        config["suppress_tokens"] = list(range(100_000))
    result = _inspect_edited(example_release, release_copy, onboard_cli, tmp_path, "qwen3_moe", edit)
    assert _one_line_naming(result, "suppress_tokens: a list of 100000 items"), result.err


@pytest.mark.parametrize("index", [4, -1])
def test_a_dense_layer_index_outside_the_model_is_bad_input(example_release, release_copy, onboard_cli, tmp_path, index):
    def edit(config):
        config["mlp_only_layers"] = [index]
    result = _inspect_edited(example_release, release_copy, onboard_cli, tmp_path, "qwen3_next", edit)
    assert _one_line_naming(result, f"mlp_only_layers[0]: layer {index} does not exist"), result.err


def _as_unknown_family(config: dict) -> None:
    """Renamed so transformers (whose config class refuses more) does not know it: only our checks judge it."""
    config["model_type"] = "acme_linear"


def test_per_layer_lists_of_an_unknown_family_are_checked_by_their_length(example_release, release_copy, onboard_cli,
                                                                           tmp_path):
    def edit(config):
        _as_unknown_family(config)
        config["layer_types"] = config["layer_types"] + ["full_attention"]
    result = _inspect_edited(example_release, release_copy, onboard_cli, tmp_path, "kimi_linear", edit)
    assert _one_line_naming(result, "layer_types: has 5 entries but num_hidden_layers is 4"), result.err


def test_an_ffn_type_we_do_not_know_is_a_gap_naming_it(example_release, release_copy, onboard_cli, tmp_path):
    """A consistent mlp_layer_types (one per layer) with a type we do not know: that layer's FFN runs as its own
    module (exit 3), never read as dense and never bad input."""
    def edit(config):
        _as_unknown_family(config)
        config["mlp_layer_types"][1] = "hyper_ffn"
    result = _inspect_edited(example_release, release_copy, onboard_cli, tmp_path, "kimi_linear", edit, "--json")
    assert result.code == 3, result.err
    report = json.loads(result.out)
    own_ffn = [o for o in report["ops"] if o["op"] == "own:ffn"]
    assert own_ffn and 1 in own_ffn[0]["layers"] and "hyper_ffn" in own_ffn[0]["detail"], report["ops"]
    assert any(u["item"] == "mlp_layer_types" and "hyper_ffn" in u["detail"] for u in report["unrecognized"])


@pytest.mark.parametrize("key, value", [("rope_theta", 0), ("factor", -1.0)])
def test_a_rotary_base_or_scale_at_or_below_zero_is_bad_input(example_release, release_copy, onboard_cli, tmp_path,
                                                             key, value):
    """No rotary embedding has a base or a scaling factor <= 0 (its frequencies are powers of the base, its
    positions are divided by the factor); recognition read a zero base as the default 10000."""
    def edit(config):
        config["rope_parameters"].update({key: value, "rope_type": "linear" if key == "factor" else "default"})
    result = _inspect_edited(example_release, release_copy, onboard_cli, tmp_path, "qwen3_next", edit)
    assert _one_line_naming(result, f"rope_parameters.{key}: must be a number above 0"), result.err


@pytest.mark.parametrize("number", [0, 5])
def test_a_kimi_layer_number_outside_the_model_is_bad_input(example_release, release_copy, onboard_cli, tmp_path, number):
    """Kimi's linear_attn_config lists its layers numbered from 1; its config class fills layer_types[n - 1],
    so a 0 silently named the last layer and a number past the count was transformers' IndexError."""
    def edit(config):
        config["linear_attn_config"] = {"full_attn_layers": [number], "kda_layers": [1, 2, 3]}
    result = _inspect_edited(example_release, release_copy, onboard_cli, tmp_path, "kimi_linear", edit)
    assert _one_line_naming(result, f"linear_attn_config.full_attn_layers[0]: layer {number} does not exist"), result.err
