"""Reading a quantized release: quantization_config into a StoredFormat, each quantized weight paired with its scales
(tampering is exit 2 naming both tensors), formats we do not support yet a gap (exit 3 naming them), the logical view
recognition sees (counts from logical shapes), stored bytes in the budget and the gap report's words."""
from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest
import torch
import yaml

from onboard.cli import main
from onboard.gap.budget import GIB, budget
from onboard.gap.render import gap_markdown
from onboard.gap.report import analyze
from onboard.package.derivation import derive_weight_map
from onboard.recognize.recognizer import recognize
from onboard.release.config_view import NotRecognized
from onboard.release.manifest import read_manifest
from onboard.release.quantization import stored_format
from runtime.formats.scheme import MXFP4, FP8Block
from runtime.spec import read_spec
from tests.onboard.formats.stored_release import edit_config, edit_tensors, fp8_release, mxfp4_release, packed_release

DEEPSEEK_QC = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
MXFP4_GROUP = {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
               "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True}}
# Kimi K2-Thinking's quantization_config: INT4 weights in groups of 32, packed in int32
K2_INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
           "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
               "num_bits": 4, "type": "int", "group_size": 32, "strategy": "group", "symmetric": True}}},
           "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]}
NVFP4_CT = {"quant_method": "compressed-tensors", "config_groups": {"group_0": dict(
    MXFP4_GROUP, format="nvfp4-pack-quantized", weights={"num_bits": 4, "type": "float", "group_size": 16})}}
NVFP4_MODELOPT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}


@pytest.mark.parametrize("qc, expected", [
    (DEEPSEEK_QC, FP8Block(block=(128, 128))),
    (dict(DEEPSEEK_QC, scale_fmt="ue8m0"), FP8Block(block=(128, 128), power_of_two=True)),
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}, MXFP4(layout="blocks")),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": MXFP4_GROUP}}, MXFP4(layout="packed")),
    ({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
      "config_groups": {"group_0": {k: v for k, v in MXFP4_GROUP.items() if k != "format"}}}, MXFP4(layout="packed")),
], ids=["fp8", "fp8-ue8m0", "mxfp4", "compressed-mxfp4-group", "compressed-mxfp4-top"])
def test_quantization_config_read_into_its_format(qc, expected, tmp_path):
    assert stored_format(qc, tmp_path / "config.json") == expected


@pytest.mark.parametrize("qc, named", [
    (K2_INT4, "INT4"), (NVFP4_CT, "NVFP4"), (NVFP4_MODELOPT, "NVFP4"), ({"quant_method": "awq", "bits": 4}, "awq"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor"),
    (dict(DEEPSEEK_QC, activation_scheme="static"), "static"),
], ids=["k2-int4", "nvfp4-compressed", "nvfp4-modelopt", "awq", "fp8-per-tensor", "fp8-static"])
def test_unsupported_formats_are_gaps_naming_them(qc, named, tmp_path):
    with pytest.raises(NotRecognized) as gap:
        stored_format(qc, tmp_path / "config.json")
    assert named in str(gap.value)


@pytest.fixture(scope="module")
def bf16_deepseek(example_release):
    return example_release("deepseek_v3")


@pytest.fixture(scope="module")
def fp8_small_blocks(bf16_deepseek, tmp_path_factory):
    """deepseek_v3 in FP8 with 16x16 blocks: the tiny widths span several blocks (kv_a_proj's 40 rows end in a
    partial one), and the expert width (32) is on the block grid."""
    return fp8_release(bf16_deepseek, tmp_path_factory.mktemp("fp8") / "release")


@pytest.fixture
def tampered(tmp_path):
    def copy(release):
        shutil.copytree(release, tmp_path / "release")
        return tmp_path / "release"
    return copy


def _cli(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("qc, named", [(K2_INT4, "INT4"), (NVFP4_CT, "NVFP4"), ({"quant_method": "bitnet"}, "bitnet")],
                         ids=["k2-int4", "nvfp4", "unknown"])
def test_unsupported_release_exits_3_naming_the_format(qc, named, bf16_deepseek, tampered, capsys):
    release = tampered(bf16_deepseek)
    edit_config(release, lambda config: config.update(quantization_config=qc))
    code, err = _cli(capsys, "inspect", str(release))
    assert code == 3 and named in err and "quantization_config" in err and len(err.strip().splitlines()) == 1


KV_A = "model.layers.0.self_attn.kv_a_proj_with_mqa"


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _set(name, value):
    return lambda tensors: tensors.__setitem__(name, value(tensors))


FP8_TAMPERING = {
    "scale-removed": (_drop(f"{KV_A}.weight_scale_inv"), (f"{KV_A}.weight", f"{KV_A}.weight_scale_inv")),
    "scale-transposed": (_set(f"{KV_A}.weight_scale_inv", lambda t: t[f"{KV_A}.weight_scale_inv"].T.contiguous()),
                         (f"{KV_A}.weight", f"{KV_A}.weight_scale_inv")),
    "scale-wrong-shape": (_set(f"{KV_A}.weight_scale_inv", lambda t: torch.ones(3, 3)), (f"{KV_A}.weight", f"{KV_A}.weight_scale_inv")),
    "weight-removed": (_drop(f"{KV_A}.weight"), (f"{KV_A}.weight", f"{KV_A}.weight_scale_inv")),
    "scale-on-bf16-weight": (_set("lm_head.weight_scale_inv", lambda t: torch.ones(16, 4)),
                             ("lm_head.weight", "lm_head.weight_scale_inv")),
}


@pytest.mark.parametrize("case", FP8_TAMPERING)
def test_fp8_tampering_exits_2_naming_both_tensors(case, fp8_small_blocks, tampered, capsys):
    edit, names = FP8_TAMPERING[case]
    release = tampered(fp8_small_blocks)
    edit_tensors(release, edit)
    code, err = _cli(capsys, "inspect", str(release))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert all(name in err for name in names), err


def test_block_size_disagreeing_with_the_scale_grid_exits_2(fp8_small_blocks, tampered, capsys):
    release = tampered(fp8_small_blocks)
    edit_config(release, lambda config: config["quantization_config"].update(weight_block_size=[32, 32]))
    code, err = _cli(capsys, "inspect", str(release))
    scale = re.search(r"(\S+)\.weight_scale_inv", err)
    assert code == 2 and "32x32 blocks" in err and scale and f"does not match {scale.group(1)}.weight " in err, err


EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def mxfp4_blocks(example_release, tmp_path_factory):
    return mxfp4_release(example_release("gpt_oss"), tmp_path_factory.mktemp("mxfp4") / "release")


@pytest.mark.parametrize("case", ["scales-removed", "blocks-removed", "scales-wrong-shape", "not-converted"])
def test_mxfp4_tampering_exits_2_naming_both(case, mxfp4_blocks, tampered, capsys):
    release = tampered(mxfp4_blocks)
    if case == "not-converted":
        edit_config(release, lambda c: c["quantization_config"]["modules_to_not_convert"].append("model.layers.*.mlp.experts"))
    else:
        edit = {"scales-removed": _drop(EXPERTS + "_scales"), "blocks-removed": _drop(EXPERTS + "_blocks"),
                "scales-wrong-shape": _set(EXPERTS + "_scales", lambda t: t[EXPERTS + "_scales"][..., :1].clone())}[case]
        edit_tensors(release, edit)
    code, err = _cli(capsys, "inspect", str(release))
    blocks = re.search(r"(model\.layers\.\d+\.mlp\.experts\.\w+)_blocks", err)
    assert code == 2 and blocks and f"{blocks.group(1)}_scales" in err, err
    if case != "not-converted":
        assert EXPERTS + "_blocks" in err


def test_packed_scale_removed_exits_2(bf16_deepseek, tmp_path, capsys):
    release = packed_release(bf16_deepseek, tmp_path / "packed")
    codes = "model.layers.1.mlp.experts.3.down_proj.weight_packed"
    edit_tensors(release, _drop(codes.replace("packed", "scale")))
    code, err = _cli(capsys, "inspect", str(release))
    assert code == 2 and codes in err and codes.replace("packed", "scale") in err


@pytest.mark.parametrize("family, weights", [("deepseek_v3", "fp8"), ("gpt_oss", "mxfp4")])
def test_logical_view_counts_and_stored_bytes(family, weights, stored_example_twin, stored_example_release):
    bf16 = read_manifest(stored_example_twin(family, weights))
    stored = read_manifest(stored_example_release(family, weights))
    spec, bf16_spec = recognize(stored), recognize(bf16)
    # recognition sees what a bf16 release has: the same names and shapes, the same counts
    assert {n: t.shape for n, t in stored.tensors.items()} == {n: t.shape for n, t in bf16.tensors.items()}
    assert spec.params == bf16_spec.params and stored.total_params == bf16.total_params
    assert not any(u.item == "quantization_config" for u in spec.unrecognized)
    # every tensor the release stores is read, so its stored bytes are the release's bytes on disk
    assert sum(group.bytes for group in spec.stored_groups.values()) == stored.total_bytes
    memory, bf16_memory = budget(spec), budget(bf16_spec)
    assert memory.weights_gib * GIB == stored.total_bytes < bf16.total_bytes == bf16_memory.weights_gib * GIB
    assert spec.stored_groups["experts_routed"].params == bf16_spec.params.experts_routed


def test_stored_bytes_from_the_index_alone_equal_the_headers(fp8_small_blocks, tmp_path):
    """From the index alone the bytes are computed from the logical shapes; with the shards, read off the headers."""
    full = read_manifest(fp8_small_blocks)
    index_only = tmp_path / "index-only"
    index_only.mkdir()
    shutil.copy(fp8_small_blocks / "config.json", index_only / "config.json")
    weight_map = {name: "model-00001-of-00001.safetensors" for name in full.released}
    (index_only / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": full.total_bytes}, "weight_map": weight_map}))
    alone = read_manifest(index_only)
    assert alone.stored.keys() == full.stored.keys() and alone.total_params is None
    assert recognize(alone).stored_groups == recognize(full).stored_groups


def test_gap_report_names_the_format_per_tensor_group(mxfp4_blocks, capsys):
    manifest = read_manifest(mxfp4_blocks)
    text = gap_markdown(analyze(recognize(manifest), manifest))
    assert "experts_routed: MXFP4 (gpt-oss blocks)" in text and "attention: bf16" in text and "as stored" in text
    assert main(["inspect", str(mxfp4_blocks)]) == 0
    assert "stored as: " in capsys.readouterr().out


def test_weight_map_stored_entries(mxfp4_blocks, fp8_small_blocks):
    manifest = read_manifest(mxfp4_blocks)
    entry = derive_weight_map(recognize(manifest), manifest)[EXPERTS]
    # the bf16 experts are [E, in, out] and transposed on loading; the blocks hold [E, out, in] already
    assert entry["transpose"] is False and entry["target"] == "layers.0.ffn.experts.w_gate_up"
    assert entry["stored"] == {"format": {"kind": "mxfp4", "layout": "blocks"}, "codes": EXPERTS + "_blocks",
                               "scale": EXPERTS + "_scales"}
    manifest = read_manifest(fp8_small_blocks)
    weight_map = derive_weight_map(recognize(manifest), manifest)
    up = weight_map["model.layers.1.mlp.experts.2.up_proj.weight"]
    assert up["rows"] == [32, 64] and up["stored"]["format"] == {"kind": "fp8_block", "block": [16, 16],
                                                                "power_of_two": False}
    assert "stored" not in weight_map["model.layers.1.mlp.gate.weight"]


def test_fp8_rows_off_the_block_grid_are_a_gap(example_release, tmp_path):
    """The bf16 example's experts are 32 rows wide (the FP8 example's are 128): encoded as DeepSeek-V3's FP8 release
    is, gate and up cannot share one w_gate_up in 128-row scale blocks."""
    from onboard.examples.stored import encode_release, stored_release

    release = shutil.copytree(example_release("deepseek_v3"), tmp_path / "release")
    encode_release(release, stored_release("deepseek_v3", "fp8"))
    manifest = read_manifest(release)
    with pytest.raises(NotRecognized, match="off the 128-row blocks"):
        derive_weight_map(recognize(manifest), manifest)


def test_spec_keeps_the_format_and_old_hashes(fp8_small_blocks, bf16_deepseek):
    spec = recognize(read_manifest(fp8_small_blocks))
    assert read_spec(json.loads(spec.model_dump_json())) == spec
    assert spec.stored_format == FP8Block(block=(16, 16))
    # a bf16 release's spec hashes as it did before the stored-format fields existed
    bf16 = recognize(read_manifest(bf16_deepseek))
    data = json.loads(bf16.model_dump_json())
    assert data.pop("stored_format") is None and data.pop("stored_groups") is None
    assert bf16.spec_hash() == hashlib.sha256(bf16.model_dump_json(exclude={"stored_format", "stored_groups"}).encode()).hexdigest()[:16]
    assert read_spec(data).stored_format is None


def test_package_and_pr_name_the_stored_format(mxfp4_blocks, tmp_path):
    from onboard.package.writer import write_package
    from onboard.review.pr import render_pr

    pkg, report = write_package(mxfp4_blocks, tmp_path / "pkg")
    spec = read_spec(json.loads((pkg / "spec.json").read_text()))
    assert spec.stored_format == MXFP4(layout="blocks")
    assert json.loads((pkg / "weight_map.json").read_text())[EXPERTS]["stored"]["codes"] == EXPERTS + "_blocks"
    # the status and reasons the graph's review node records before PR.md is rendered
    package_yaml = pkg / "package.yaml"
    package_yaml.write_text(yaml.safe_dump(yaml.safe_load(package_yaml.read_text()) | {"status": "trainable", "reasons": []}))
    text = render_pr(pkg, spec, report, [], 0)
    assert "stored weights" in text and "experts_routed: MXFP4 (gpt-oss blocks)" in text
