"""The hostile-input probe of issue 16, case by case: each case breaks one thing of a real release.

Every run must exit 0, 2 or 3 with no traceback, within 30 s and 2 GiB (`CliRun.assert_bounded`);
each case also says which exit it expects and what the one line (or the report) must say.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from onboard.release.manifest import INDEX_NAME


@pytest.fixture
def release(example_release, tmp_path) -> Path:
    """A copy of a tiny Qwen3-MoE release (transformers knows it, so the meta check runs too)."""
    return Path(shutil.copytree(example_release("qwen3_moe"), tmp_path / "release"))


def edit_config(root: Path, **changes) -> None:
    config = json.loads((root / "config.json").read_text())
    config.update(changes)
    (root / "config.json").write_text(json.dumps(config))


def edit_index(root: Path, change) -> None:
    index = json.loads((root / INDEX_NAME).read_text())
    change(index)
    (root / INDEX_NAME).write_text(json.dumps(index))


def shards(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors"))


def add_tensor(root: Path, name: str) -> None:
    """One more real shard holding one tensor with this name, listed in the index."""
    save_file({name: torch.zeros(2)}, root / "extra.safetensors")
    edit_index(root, lambda index: index["weight_map"].update({name: "extra.safetensors"}))


def deep(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels):
        value = {"x": value}
    return value


# name -> (config changes, expected exit, text the stderr line must hold)
CONFIG_CASES = {
    "mlp_only_layers-int": ({"mlp_only_layers": 5}, 2, "mlp_only_layers: must be a list"),
    "architectures-object": ({"architectures": {"a": 1}}, 2, "architectures: must be a list"),
    "rope_theta-string": ({"rope_theta": "abc"}, 2, "rope_theta: must be"),
    "partial_rotary_factor-string": ({"partial_rotary_factor": "1"}, 2, "partial_rotary_factor: must be"),
    "top_k-100-of-8-experts": ({"num_experts_per_tok": 100}, 2, "num_experts_per_tok: routes to 100"),
    "rms_norm_eps-negative": ({"rms_norm_eps": -1}, 2, "rms_norm_eps: must be a number in (0, 1)"),
    "experts-2^24": ({"num_local_experts": 1 << 24}, 2, "num_local_experts: 16777216 exceeds"),
    "layers-2^24": ({"num_hidden_layers": 1 << 24}, 2, "num_hidden_layers: 16777216 exceeds"),
    "nesting-500-deep": ({"extra": deep(500)}, 2, "nested deeper than"),
    "surrogate-key": ({"\ud800": 1}, 2, "\\ud800: key is not valid Unicode"),
    "surrogate-value": ({"hidden_act": "\udfff"}, 2, "hidden_act: not valid Unicode"),
    "string-for-float-rejected-by-transformers": ({"router_aux_loss_coef": "x"}, 2, "refused by transformers' config class"),
}


@pytest.mark.parametrize("case", CONFIG_CASES, ids=list(CONFIG_CASES))
@pytest.mark.parametrize("fmt", [[], ["--json"]], ids=["rich", "json"])
def test_config_case(release, onboard_cli, case, fmt):
    changes, code, needle = CONFIG_CASES[case]
    edit_config(release, **changes)
    result = onboard_cli("inspect", release, *fmt)
    result.assert_bounded()
    assert result.code == code, result.err
    assert needle in result.err and str(release / "config.json") in result.err, result.err


@pytest.mark.parametrize("changes", [{"hidden_act": "bogus"}, {"pad_token_id": 1000000}], ids=["hidden_act-bogus", "pad_token_id-huge"])
def test_values_the_config_class_accepts_are_not_bad_input(release, onboard_cli, changes):
    """Valid for transformers' config class: never exit 2; a model it cannot build is a failed cross-check."""
    edit_config(release, **changes)
    result = onboard_cli("inspect", release, "--json")
    result.assert_bounded()
    assert result.code in (0, 3)
    meta = json.loads(result.out)["meta_check"]
    if "hidden_act" in changes:
        assert not meta["params_agree"] and "could not build" in meta["layer_disagreements"][0]


def test_torch_dtype_list_with_the_index_only(release, onboard_cli):
    for shard in shards(release):
        shard.unlink()
    edit_config(release, torch_dtype=["bfloat16"], dtype=None)
    result = onboard_cli("inspect", release)
    result.assert_bounded()
    assert result.code == 2 and "torch_dtype: must be a string" in result.err


def test_header_beyond_the_tensor_cap_is_refused_before_parsing(release, onboard_cli):
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(200_001)}
    raw = json.dumps(header).encode()
    shard = shards(release)[0]
    shard.write_bytes(len(raw).to_bytes(8, "little") + raw)
    result = onboard_cli("inspect", release, "--json")
    result.assert_bounded()
    assert result.code == 2 and f"{shard}: header lists more than 200000 tensors" in result.err


@pytest.mark.parametrize("name, shown", [("[/oops]", "[/oops]"), ("model.a\nb", "model.a\\nb"), ("[bold]x", "[bold]x")],
                         ids=["closing-markup", "newline", "opening-markup"])
def test_names_are_printed_as_themselves(release, onboard_cli, name, shown):
    add_tensor(release, name)
    edit_config(release, **{name: 1})
    for fmt in ([], ["--markdown"]):
        result = onboard_cli("inspect", release, *fmt)
        result.assert_bounded()
        assert result.code in (0, 3) and shown in result.out, result.out[-3000:]
        if "\n" in name:
            assert name not in result.out


def test_surrogate_tensor_name_in_the_index(release, onboard_cli, tmp_path):
    for shard in shards(release):
        shard.unlink()
    edit_index(release, lambda index: index["weight_map"].update({"model.\ud800": "model-00001-of-00003.safetensors"}))
    for args in (["inspect", release], ["inspect", release, "--json"], ["new-model", release, "--out", tmp_path / "a" / "b" / "pkg"]):
        result = onboard_cli(*args)
        result.assert_bounded()
        assert result.code == 2 and "weight_map.model.\\ud800: not valid Unicode" in result.err, result.err
    assert not (tmp_path / "a").exists()  # new-model left no parent folders


def test_shard_symlink_loop(release, onboard_cli):
    shard = shards(release)[1]
    shard.unlink()
    shard.symlink_to(shard.name)
    result = onboard_cli("inspect", release)
    result.assert_bounded()
    assert result.code == 2 and "cannot be resolved" in result.err


def test_shard_name_longer_than_the_file_system_takes(release, onboard_cli):
    long_name = "x" * 300 + ".safetensors"
    edit_index(release, lambda index: index["weight_map"].update({"lm_head.weight": long_name}))
    result = onboard_cli("inspect", release)
    result.assert_bounded()
    assert result.code == 2 and "weight_map.lm_head.weight" in result.err


def test_config_symlink_outside_the_release(release, onboard_cli, tmp_path):
    outside = tmp_path / "elsewhere.json"
    (release / "config.json").rename(outside)
    (release / "config.json").symlink_to(outside)
    result = onboard_cli("inspect", release)
    result.assert_bounded()
    assert result.code == 2 and "symlink resolving outside the model folder" in result.err


def test_out_inside_the_model_folder(release, onboard_cli):
    before = sorted(p.name for p in release.iterdir())
    result = onboard_cli("new-model", release, "--out", release / "pkg")
    result.assert_bounded()
    assert result.code == 2 and "inside the model folder" in result.err
    assert sorted(p.name for p in release.iterdir()) == before


def test_stale_partial_of_a_dead_process_is_removed(release, onboard_cli, tmp_path):
    """What SIGKILL leaves: `.pkg.partial-PID` of a PID that no longer runs. A live one's stays."""
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".pkg.partial-{int(finished.stdout)}"
    live = tmp_path / f".pkg.partial-{os.getppid()}"
    for partial in (dead, live):
        (partial / "alignment").mkdir(parents=True)
    result = onboard_cli("new-model", release, "--out", tmp_path / "pkg")
    result.assert_bounded()
    assert result.code in (0, 3) and (tmp_path / "pkg" / "spec.json").exists()
    assert not dead.exists() and live.exists()
    assert not (tmp_path / ".pkg.lock").exists()


def test_concurrent_new_model_on_one_out(release, tmp_path):
    """Two real processes race for one --out: one writes the package, the other fails in one line."""
    command = [sys.executable, "-m", "onboard.cli", "new-model", str(release), "--out", str(tmp_path / "pkg")]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(run.wait(timeout=300), run.stderr.read()) for run in runs]
    codes = sorted(code for code, _ in results)
    assert codes[0] in (0, 3) and codes[1] == 2, results
    loser = next(err for code, err in results if code == 2).strip()
    assert len(loser.splitlines()) == 1 and ("already exists" in loser or "another `onboard new-model`" in loser), loser
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg", "release"]


def test_nonexistent_path(onboard_cli, tmp_path):
    result = onboard_cli("inspect", tmp_path / "nope")
    result.assert_bounded()
    assert result.code == 2 and "nope: does not exist" in result.err


def test_a_bug_is_one_line_and_a_trace_file(onboard_cli, monkeypatch, tmp_path):
    """A bug cannot be made on purpose in real code, so one is planted: the command's function raises."""
    import onboard.commands.inspect

    def broken(args):
        return {}["missing"]

    monkeypatch.setattr(onboard.commands.inspect, "run", broken)
    result = onboard_cli("inspect", tmp_path)
    assert result.code == 1 and "Traceback" not in result.err
    line = result.err.strip()
    assert len(line.splitlines()) == 1 and "internal error" in line and "KeyError" in line, line
    trace = Path(line.rsplit("full trace in ", 1)[1])
    assert "Traceback" in trace.read_text() and "broken" in trace.read_text()
    trace.unlink()


@pytest.mark.parametrize("experts, code", [(896, 0), (12_000, 2)], ids=["as-released", "experts-x-layers-beyond-the-tensors"])
def test_per_expert_names_bound_the_expert_count(seed_dir, onboard_cli, tmp_path, experts, code):
    """The 2.8T index stores experts one by one: 12,000 experts in 61 layers would need 2.2M
    tensors; the release has 157k, so the per-expert work the count asks for is never started."""
    release = tmp_path / "seed"
    release.mkdir()
    shutil.copy(seed_dir / INDEX_NAME, release / INDEX_NAME)
    config = json.loads((seed_dir / "config.json").read_text())
    config["text_config"]["n_routed_experts"] = experts
    (release / "config.json").write_text(json.dumps(config))
    result = onboard_cli("inspect", release, "--json")
    result.assert_bounded()
    assert result.code == code, result.err
    if code == 2:
        assert "text_config.n_routed_experts: 12000 experts in 61 layers need more tensors" in result.err


def test_model_folder_name_not_utf8(release, onboard_cli, tmp_path):
    """A folder named with bytes that are not UTF-8 (as argv hands them over): refused, named escaped."""
    renamed = release.rename(tmp_path / os.fsdecode(b"bad\xff"))
    for fmt in ([], ["--json"]):
        result = onboard_cli("inspect", renamed, *fmt)
        result.assert_bounded()
        assert result.code == 2 and "bad\\udcff: the folder's path is not valid UTF-8" in result.err, result.err
