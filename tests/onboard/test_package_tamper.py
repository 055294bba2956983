"""A package tampered after `onboard new-model`: `align` and `train` refuse it alike (exit 2, the same one line
naming the file), before any tier or step, and nothing outside the package is written through a symlink.

Each case starts from a real package of a real release (the tiny qwen3_next example, copied: shards hard-linked,
so a case that changes a shard replaces the file) written by onboard/package/writer.py, and edits it as a hostile pull
request could: the spec or weight map edited and re-hashed, the release's weights changed after new-model,
a huge LoRA rank, symlinks and FIFOs where package files are."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from onboard.cli import main
from onboard.package.writer import write_package
from runtime.spec import ModelSpec
from tests.onboard.conftest import copy_release
from tests.package_status import record_alignment_passed

FAMILY = "qwen3_next"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tampered(example_release, tmp_path):
    """(release, package, data): a package of a private copy of the example release."""
    release = copy_release(example_release(FAMILY), tmp_path / "release")
    pkg = record_alignment_passed(write_package(release, tmp_path / "pkg")[0])
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"The mill number {i} turns by the river."}) + "\n" for i in range(8)))
    return release, pkg, data


def _align(pkg: Path) -> list[str]:
    return ["align", str(pkg), "--tiers", "1"]


def _train(pkg: Path, data: Path) -> list[str]:
    return ["train", str(pkg), "--data", str(data), "--steps", "1", "--seq-len", "16", "--no-progress"]


def _refused(capsys, argv: list[str], after_progress: bool = False) -> str:
    """The one stderr line of a command that exits 2 (after align's progress lines, when the refusal comes from
    loading the weights inside a tier)."""
    assert main(argv) == 2, argv
    lines = capsys.readouterr().err.strip().splitlines()
    assert (after_progress or len(lines) == 1) and not any("Traceback" in line for line in lines), lines
    assert lines[-1].startswith("onboard: error: "), lines
    return lines[-1]


def _both_refuse(capsys, pkg: Path, data: Path, after_progress: bool = False) -> str:
    """align and train exit 2 with the same line; returns it."""
    line = _refused(capsys, _align(pkg), after_progress)
    assert _refused(capsys, _train(pkg, data)) == line
    assert not (pkg / "runs").exists()
    return line


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1))


def _rehash(pkg: Path) -> None:
    """package.yaml's spec_hash made to match the edited spec.json, as a tamperer would."""
    spec = ModelSpec.model_validate_json((pkg / "spec.json").read_text())
    package = yaml.safe_load((pkg / "package.yaml").read_text())
    (pkg / "package.yaml").write_text(yaml.safe_dump({**package, "spec_hash": spec.spec_hash()}, sort_keys=False))


def test_the_untampered_package_aligns_and_trains(tampered, capsys):
    _, pkg, data = tampered
    assert main(_align(pkg)) == 0
    assert main(_train(pkg, data)) == 0


@pytest.mark.parametrize("edit, key, value", [
    (lambda s: s["layers"][3]["ffn"].update(top_k=3), "layers.3.ffn.top_k", "3 where"),
    (lambda s: s["norm"].update(eps=1e-3), "norm.eps", "0.001 where"),
], ids=["top_k", "eps"])
def test_a_spec_edited_and_rehashed_is_refused(tampered, capsys, edit, key, value):
    _, pkg, data = tampered
    _edit_json(pkg / "spec.json", edit)
    _rehash(pkg)
    line = _both_refuse(capsys, pkg, data)
    assert line.startswith(f"onboard: error: {pkg / 'spec.json'}: {key}: {value} the spec `onboard new-model` "
                           "derives from the release has"), line


def _swap_k_v(weight_map: dict) -> None:
    k, v = "model.layers.3.self_attn.k_proj.weight", "model.layers.3.self_attn.v_proj.weight"
    weight_map[k]["target"], weight_map[v]["target"] = weight_map[v]["target"], weight_map[k]["target"]


@pytest.mark.parametrize("edit, key", [
    (_swap_k_v, "model.layers.3.self_attn.k_proj.weight.target"),
    (lambda m: m["model.layers.3.mlp.experts.0.gate_proj.weight"].update(rows=[1, 33]),
     "model.layers.3.mlp.experts.0.gate_proj.weight.rows.0"),
    (lambda m: m["model.layers.3.mlp.experts.0.up_proj.weight"].update(rows=[32, 64000]),
     "model.layers.3.mlp.experts.0.up_proj.weight.rows.1"),
    (lambda m: m["model.layers.3.mlp.experts.0.down_proj.weight"].update(expert=99),
     "model.layers.3.mlp.experts.0.down_proj.weight.expert"),
    (lambda m: m["model.norm.weight"].update(target="layers.9.nowhere.weight"), "model.norm.weight.target"),
    (lambda m: m.pop("model.norm.weight"), "model.norm.weight"),
], ids=["k_v_swapped", "rows_shifted", "rows_out_of_range", "expert_out_of_range", "absent_target", "entry_removed"])
def test_a_weight_map_that_is_not_the_derived_one_is_refused(tampered, capsys, edit, key):
    _, pkg, data = tampered
    _edit_json(pkg / "weight_map.json", edit)
    line = _both_refuse(capsys, pkg, data)
    assert line.startswith(f"onboard: error: {pkg / 'weight_map.json'}: {key}: "), line


def _rewrite_shard(release: Path, change) -> Path:
    """The release's first shard rewritten (a new file, the hard link to the cached release broken) with
    change(tensors) applied; returns its path."""
    shard = sorted(release.glob("*.safetensors"))[0]
    with safe_open(shard, "pt") as f:
        tensors, metadata = {n: f.get_tensor(n) for n in f.keys()}, f.metadata()
    change(tensors)
    shard.unlink()
    save_file(tensors, shard, metadata=metadata)
    return shard


def _nan_first_matrix(tensors: dict) -> None:
    name = next(n for n, t in tensors.items() if t.dim() == 2)
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = float("nan")


def _swap_same_shape(tensors: dict) -> None:
    names = sorted(tensors)
    a, b = next((a, b) for a in names for b in names if a < b and tensors[a].shape == tensors[b].shape
                and tensors[a].dim() == 2 and not tensors[a].equal(tensors[b]))
    tensors[a], tensors[b] = tensors[b], tensors[a]


@pytest.mark.parametrize("change", [_nan_first_matrix, _swap_same_shape], ids=["nan", "swapped_same_shape"])
def test_release_weights_changed_after_new_model_are_refused(tampered, capsys, change):
    release, pkg, data = tampered
    shard = _rewrite_shard(release, change)
    line = _both_refuse(capsys, pkg, data)
    assert line.startswith(f"onboard: error: {shard}: changed since `onboard new-model` read it"), line


def test_a_truncated_shard_is_refused(tampered, capsys):
    release, pkg, data = tampered
    shard = sorted(release.glob("*.safetensors"))[0]
    content = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(content[: len(content) // 2])
    line = _both_refuse(capsys, pkg, data)
    # its header now promises more bytes than the file holds: the release's reader names it first
    assert line.startswith(f"onboard: error: {shard}: data_offsets: "), line


def test_nan_weights_in_the_release_new_model_read_are_refused_naming_the_tensor(example_release, tmp_path, capsys):
    """NaN before new-model (so the hashes agree): loading the base weights names the tensor."""
    release = copy_release(example_release(FAMILY), tmp_path / "release")
    shard = _rewrite_shard(release, _nan_first_matrix)
    with safe_open(shard, "pt") as f:
        name = next(n for n in f.keys() if f.get_tensor(n).isnan().any())
    pkg = record_alignment_passed(write_package(release, tmp_path / "pkg")[0])
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"The mill number {i} turns."}) + "\n" for i in range(8)))
    line = _both_refuse(capsys, pkg, data, after_progress=True)
    assert line == (f"onboard: error: {shard}: {name}: holds non-finite values (NaN or infinity): a released weight "
                    "must be finite"), line


def test_unrecorded_shards_are_refused(tampered, capsys):
    """A package.yaml whose shard records were removed does not skip the check."""
    _, pkg, data = tampered
    package = yaml.safe_load((pkg / "package.yaml").read_text())
    first = sorted(package["source"]["shards"])[0]
    package["source"]["shards"] = {}
    (pkg / "package.yaml").write_text(yaml.safe_dump(package, sort_keys=False))
    line = _both_refuse(capsys, pkg, data)
    assert line == (f"onboard: error: {pkg / 'package.yaml'}: source.shards.{first}: missing: the release holds this "
                    "shard but `onboard new-model` recorded no hash of it")


@pytest.mark.parametrize("text, key", [("rank: 1000000000\n", "rank"), ("alpha: .inf\n", "alpha"),
                                       ("targets: ['model.layers.*.nothing']\n", "targets")],
                         ids=["huge_rank", "infinite_alpha", "absent_target"])
def test_lora_values_are_validated_alike(tampered, capsys, text, key):
    _, pkg, data = tampered
    lora = yaml.safe_load((pkg / "lora.yaml").read_text())
    (pkg / "lora.yaml").write_text(yaml.safe_dump({**lora, **yaml.safe_load(text)}))
    line = _both_refuse(capsys, pkg, data)
    assert line.startswith(f"onboard: error: {pkg / 'lora.yaml'}: {key}: "), line


def test_a_bad_memory_plan_is_refused_alike(tampered, capsys):
    _, pkg, data = tampered
    plan = yaml.safe_load((pkg / "plan.yaml").read_text())
    (pkg / "plan.yaml").write_text(yaml.safe_dump({**plan, "memory": {"recompute": "attention"}}))
    line = _both_refuse(capsys, pkg, data)
    assert line.startswith(f"onboard: error: {pkg / 'plan.yaml'}: memory: "), line


def test_spec_json_linked_to_dev_zero_is_refused(tampered, capsys):
    _, pkg, data = tampered
    (pkg / "spec.json").unlink()
    (pkg / "spec.json").symlink_to("/dev/zero")
    line = _both_refuse(capsys, pkg, data)
    assert line.startswith(f"onboard: error: {pkg / 'spec.json'}: not a regular file"), line


def test_a_report_linked_outside_is_never_written(tampered, tmp_path, capsys):
    _, pkg, _ = tampered
    outside = tmp_path / "users-file.txt"
    outside.write_text("the user's own file\n")
    (pkg / "alignment" / "report.json").symlink_to(outside)
    line = _refused(capsys, _align(pkg))
    assert line.startswith(f"onboard: error: {pkg / 'alignment' / 'report.json'}: not a regular file"), line
    assert outside.read_text() == "the user's own file\n"


@pytest.mark.parametrize("folder", ["alignment", "runs"])
def test_a_folder_linked_outside_is_never_written_through(tampered, tmp_path, capsys, folder):
    _, pkg, data = tampered
    outside = tmp_path / "users-folder"
    outside.mkdir()
    if (pkg / folder).exists():
        (pkg / folder).rmdir()
    (pkg / folder).symlink_to(outside)
    argv = _align(pkg) if folder == "alignment" else _train(pkg, data)
    line = _refused(capsys, argv)
    assert line.startswith(f"onboard: error: {pkg / folder}: not a folder"), line
    assert list(outside.iterdir()) == []


def test_a_link_inside_a_resumed_run_folder_is_refused(tampered, tmp_path, capsys):
    _, pkg, data = tampered
    outside = tmp_path / "users-file.txt"
    outside.write_text("mine\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(outside)
    line = _refused(capsys, [*_train(pkg, data), "--out", str(run)])
    assert line.startswith(f"onboard: error: {run / 'metrics.jsonl'}: not a regular file or folder"), line
    assert outside.read_text() == "mine\n"


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "onboard.cli", *argv], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT)


@pytest.mark.parametrize("name", ["lora.yaml", "plan.yaml"])
def test_a_fifo_in_place_of_a_package_file_is_refused_not_waited_on(tampered, name):
    """Real processes: a read that blocked on the FIFO would hang until the timeout fails the test."""
    _, pkg, data = tampered
    (pkg / name).unlink()
    os.mkfifo(pkg / name)
    lines = []
    for argv in (_align(pkg), _train(pkg, data)):
        result = _cli(*argv)
        assert result.returncode == 2, result.stderr
        lines.append(result.stderr.strip().splitlines())
    assert lines[0] == lines[1] and len(lines[0]) == 1, lines
    assert lines[0][0].startswith(f"onboard: error: {pkg / name}: not a regular file"), lines


def test_bench_refuses_what_align_refuses(tampered, capsys):
    _, pkg, data = tampered
    _edit_json(pkg / "weight_map.json", _swap_k_v)
    line = _refused(capsys, _align(pkg))
    assert _refused(capsys, ["bench", str(pkg), "--steps", "1", "--seq-len", "16"]) == line


def test_package_io_caps_what_it_reads_and_writes_only_through_real_folders(tmp_path):
    from onboard import package_io
    from onboard.errors import BadInput

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "big.json").write_text("x" * 11)
    with pytest.raises(BadInput, match="11 bytes, over the 10 bytes"):
        package_io.read_text(pkg, pkg / "big.json", limit=10)
    with pytest.raises(BadInput, match="outside the folder"):
        package_io.read_text(pkg, pkg / ".." / "elsewhere.json")
    package_io.write_text(pkg, pkg / "alignment" / "report.json", "{}")
    assert (pkg / "alignment" / "report.json").read_text() == "{}"
    assert [p.name for p in (pkg / "alignment").iterdir()] == ["report.json"]  # no temp file left
    (tmp_path / "outside").mkdir()
    (pkg / "alignment" / "deeper").symlink_to(tmp_path / "outside")
    with pytest.raises(BadInput, match="deeper: not a folder"):
        package_io.write_text(pkg, pkg / "alignment" / "deeper" / "tier0.json", "{}")
    assert list((tmp_path / "outside").iterdir()) == []


def test_forged_spec_steps_with_a_matching_spec_are_not_trained_until_approved(tampered, capsys):
    """A pull request adds a step to package.yaml's spec_steps (top_k 2 -> 3 in every layer) and the spec.json
    it derives, re-hashed: the derivation holds, so only the approval stands between it and training. align
    judges it by the numbers (tier 1 disagrees with the release); train refuses it, naming package.yaml, until
    the user approves the steps."""
    from onboard.package.derivation import SetStep, derive_spec
    from onboard.release.manifest import read_manifest

    release, pkg, data = tampered
    steps = [SetStep(set="ffn.top_k", value=3)]
    (pkg / "spec.json").write_text(derive_spec(read_manifest(release), steps).model_dump_json(indent=2))
    package = yaml.safe_load((pkg / "package.yaml").read_text())
    package["spec_steps"] = [step.model_dump() for step in steps]
    (pkg / "package.yaml").write_text(yaml.safe_dump(package, sort_keys=False))
    _rehash(pkg)
    assert main(_train(pkg, data)) == 3
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (f"onboard: refused: {pkg / 'package.yaml'} spec_steps are not approved: review them (PR.md lists "
                    f"them), then run `onboard approve {pkg}`"), line
    assert not (pkg / "runs").exists()
    assert main(_align(pkg)) == 3
    capsys.readouterr()
    assert main(["approve", str(pkg)]) == 0
    assert "spec_steps sha256" in capsys.readouterr().out
    assert main(_train(pkg, data)) == 0
