"""read_manifest on real releases written by transformers' save_pretrained, and on broken ones.

The valid release is a tiny Qwen3-MoE (2 layers, hidden 32, 4 experts) saved in 6 shards; each
bad-input case copies it, breaks one thing, and expects an BadInput whose one line names the
file and the key. check_config is also run over every transformers default config, so the
size rules never refuse a real family.
"""
from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from onboard.errors import BadInput
from onboard.release.config_checks import check_config
from onboard.release.manifest import INDEX_NAME, SINGLE_NAME, read_manifest

def save_tiny_qwen3_moe(out: Path, max_shard_size: str) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(out, max_shard_size=max_shard_size)
    return out


@pytest.fixture(scope="module")
def sharded_release(tmp_path_factory) -> Path:
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("sharded"), "20KB")


@pytest.fixture(scope="module")
def single_release(tmp_path_factory) -> Path:
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("single"), "50GB")


@pytest.fixture
def release(sharded_release, tmp_path) -> Path:
    """A private copy of the sharded release that a test may break."""
    return Path(shutil.copytree(sharded_release, tmp_path / "model"))


def load_json(path: Path) -> dict:
    return json.loads(path.read_text())


def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value))


def shards_of(root: Path) -> list[Path]:
    return sorted(root.glob("model-*-of-*.safetensors"))


def test_sharded_release_matches_the_shard_headers(sharded_release):
    manifest = read_manifest(sharded_release)
    index = load_json(sharded_release / INDEX_NAME)
    assert manifest.shards_present and len(manifest.shard_files) == 6
    assert manifest.tensors.keys() == index["weight_map"].keys()
    for shard in shards_of(sharded_release):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                info = manifest.tensors[name]
                assert info.file == shard.name
                assert list(info.shape) == f.get_slice(name).get_shape() and info.dtype == "F32"
    assert manifest.total_bytes == index["metadata"]["total_size"]
    assert manifest.total_params == index["metadata"]["total_parameters"]
    assert manifest.text_config is manifest.config and manifest.vision_config is None


def test_single_file_release(single_release, sharded_release):
    single, sharded = read_manifest(single_release), read_manifest(sharded_release)
    assert single.shard_files == (SINGLE_NAME,) and single.shards_present
    assert {n: i.shape for n, i in single.tensors.items()} == {n: i.shape for n, i in sharded.tensors.items()}
    assert single.total_params == sharded.total_params


def test_index_alone_gives_names_and_byte_total(release):
    for shard in shards_of(release):
        shard.unlink()
    manifest = read_manifest(release)
    index = load_json(release / INDEX_NAME)
    assert not manifest.shards_present and manifest.num_tensors == len(index["weight_map"])
    assert all(info.shape is None and info.dtype is None for info in manifest.tensors.values())
    assert manifest.total_bytes == index["metadata"]["total_size"]
    # float32 release: 4 bytes per parameter
    assert manifest.total_params == index["metadata"]["total_parameters"]


def test_flagship_seed_index(seed_dir):
    manifest = read_manifest(seed_dir)
    assert manifest.num_tensors == 157_437 and len(manifest.shard_files) == 1130
    assert not manifest.shards_present and manifest.total_bytes == 5_619_117_592_032
    assert manifest.total_params == 5_619_117_592_032 // 2
    assert manifest.text_config["n_routed_experts"] == 896 and manifest.vision_config["depth"] == 27


@pytest.mark.parametrize("key", ["text_config", "language_config", "llm_config"])
def test_text_config_is_found_under_its_aliases(release, key):
    config = load_json(release / "config.json")
    write_json(release / "config.json", {key: config, "vision_config": {"hidden_size": 16}})
    manifest = read_manifest(release)
    assert manifest.text_config == config and manifest.vision_config == {"hidden_size": 16}


def test_symlink_inside_the_folder_is_fine(release):
    shard = shards_of(release)[1]
    shard.rename(release / "blob-1")
    shard.symlink_to("blob-1")
    assert read_manifest(release).tensors[first_tensor_in(release, shard)].file == shard.name


def test_hub_snapshot_symlinks_into_blobs_are_fine(sharded_release, tmp_path):
    # hub cache layout: snapshots/REV/<file> -> ../../blobs/<file>
    repo = tmp_path / "models--org--tiny"
    shutil.copytree(sharded_release, repo / "blobs")
    snapshot = repo / "snapshots" / "rev0"
    snapshot.mkdir(parents=True)
    for file in (repo / "blobs").iterdir():
        (snapshot / file.name).symlink_to(Path("../../blobs") / file.name)
    assert read_manifest(snapshot).num_tensors == read_manifest(sharded_release).num_tensors


def first_tensor_in(root: Path, shard: Path) -> str:
    return next(n for n, f in load_json(root / INDEX_NAME)["weight_map"].items() if f == shard.name)


def edit_config(root: Path, **changes) -> None:
    config = load_json(root / "config.json")
    config.update(changes)
    write_json(root / "config.json", config)


def edit_weight_map(root: Path, change) -> None:
    index = load_json(root / INDEX_NAME)
    change(index["weight_map"])
    write_json(root / INDEX_NAME, index)


def break_missing_config(root):
    (root / "config.json").unlink()
    return root / "config.json", None


def break_config_not_json(root):
    (root / "config.json").write_text('{"hidden_size": 32,')
    return root / "config.json", None


def break_config_not_object(root):
    write_json(root / "config.json", [{"hidden_size": 32}])
    return root / "config.json", None


def break_config_duplicate_key(root):
    (root / "config.json").write_text('{"hidden_size": 32, "hidden_size": 64}')
    return root / "config.json", "hidden_size"


def break_negative_dim(root):
    edit_config(root, hidden_size=-32)
    return root / "config.json", "hidden_size"


def break_nested_negative_dim(root):
    config = load_json(root / "config.json")
    write_json(root / "config.json", {"text_config": {**config, "moe_intermediate_size": -16}})
    return root / "config.json", "text_config.moe_intermediate_size"


def break_string_dim(root):
    edit_config(root, num_experts="4")
    return root / "config.json", "num_experts"


def break_bool_dim(root):
    edit_config(root, num_attention_heads=True)
    return root / "config.json", "num_attention_heads"


def break_absurd_dim(root):
    edit_config(root, vocab_size=1 << 40)
    return root / "config.json", "vocab_size"


def break_nan_float(root):
    edit_config(root, rms_norm_eps=math.nan)
    return root / "config.json", "rms_norm_eps"


def break_text_config_not_object(root):
    edit_config(root, text_config=[1, 2])
    return root / "config.json", "text_config"


def break_no_weights(root):
    for path in [root / INDEX_NAME, *shards_of(root)]:
        path.unlink()
    return root, None


def break_both_weight_forms(root):
    shutil.copy(shards_of(root)[0], root / SINGLE_NAME)
    return root, INDEX_NAME


def break_missing_shard(root):
    missing = shards_of(root)[2]
    missing.unlink()
    return root / INDEX_NAME, missing.name


def break_shard_name_parent(root):
    name = first_tensor_in(root, shards_of(root)[1])
    edit_weight_map(root, lambda wm: wm.update({name: "../" + wm[name]}))
    return root / INDEX_NAME, f"weight_map.{name}"


def break_shard_name_absolute(root):
    name = first_tensor_in(root, shards_of(root)[1])
    edit_weight_map(root, lambda wm: wm.update({name: str(root / wm[name])}))
    return root / INDEX_NAME, f"weight_map.{name}"


def break_shard_symlink_outside(root):
    shard = shards_of(root)[1]
    outside = root.parent / "elsewhere.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    return root / INDEX_NAME, f"weight_map.{first_tensor_in(root, shard)}"


def break_shard_is_directory(root):
    shard = shards_of(root)[1]
    name = first_tensor_in(root, shard)
    shard.unlink()
    shard.mkdir()
    return root / INDEX_NAME, f"weight_map.{name}"


def break_empty_weight_map(root):
    edit_weight_map(root, lambda wm: wm.clear())
    return root / INDEX_NAME, "weight_map"


def break_weight_map_value_not_string(root):
    edit_weight_map(root, lambda wm: wm.update({"lm_head.weight": 1}))
    return root / INDEX_NAME, "weight_map.lm_head.weight"


def break_index_only_without_total_size(root):
    for shard in shards_of(root):
        shard.unlink()
    index = load_json(root / INDEX_NAME)
    del index["metadata"]["total_size"]
    write_json(root / INDEX_NAME, index)
    return root / INDEX_NAME, "metadata.total_size"


def break_shard_header_length(root):
    shard = shards_of(root)[3]
    raw = bytearray(shard.read_bytes())
    raw[:8] = (200_000_000).to_bytes(8, "little")
    shard.write_bytes(bytes(raw))
    return shard, "header length"


def break_index_names_tensor_absent_from_header(root):
    shard = shards_of(root)[0]
    edit_weight_map(root, lambda wm: wm.update({"ghost.weight": shard.name}))
    return shard, "ghost.weight"


def break_header_tensor_absent_from_index(root):
    shard = shards_of(root)[4]
    name = first_tensor_in(root, shard)
    edit_weight_map(root, lambda wm: wm.pop(name))
    return shard, name


def break_index_places_tensor_in_other_shard(root):
    first, second = shards_of(root)[:2]
    name = first_tensor_in(root, first)
    edit_weight_map(root, lambda wm: wm.update({name: second.name}))
    return second, name


BREAKERS = [value for key, value in dict(globals()).items() if key.startswith("break_")]


@pytest.mark.parametrize("breaker", BREAKERS, ids=[b.__name__.removeprefix("break_") for b in BREAKERS])
def test_broken_release_names_file_and_key(release, breaker):
    path, key = breaker(release)
    with pytest.raises(BadInput) as info:
        read_manifest(release)
    line = info.value.one_line()
    assert "\n" not in line
    assert line.startswith(f"{path}: " if key is None else f"{path}: {key}: "), line


def test_single_file_symlink_outside_is_refused(single_release, tmp_path):
    root = Path(shutil.copytree(single_release, tmp_path / "model"))
    outside = tmp_path / "outside.safetensors"
    (root / SINGLE_NAME).rename(outside)
    (root / SINGLE_NAME).symlink_to(outside)
    with pytest.raises(BadInput, match=f"{root / SINGLE_NAME}: .*outside the model folder"):
        read_manifest(root)


def test_model_dir_must_exist(tmp_path):
    with pytest.raises(BadInput, match="nope: does not exist"):
        read_manifest(tmp_path / "nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(BadInput, match="file: not a directory"):
        read_manifest(tmp_path / "file")


@pytest.mark.parametrize(
    "config",
    [
        {"n_shared_experts": 0, "first_k_dense_replace": 0, "q_lora_rank": None},
        {"qk_rope_head_dim": 0, "chunk_size": -1, "mscale_all_dim": 1.0},
        {"max_position_embeddings": 1 << 30, "patch_size": [14, 14]},
        {"text_config": {"layers": [{"hidden_size": 8}, {"hidden_size": 16}]}},
    ],
    ids=["zero-means-none", "sentinels-and-floats", "long-context-and-lists", "nested-lists"],
)
def test_config_values_real_models_use_pass(config):
    check_config(config, "config.json")


@pytest.mark.parametrize(
    "config, key",
    [
        ({"text_config": {"layers": [{"hidden_size": 8}, {"hidden_size": 0}]}}, "text_config.layers[1].hidden_size"),
        ({"vision_config": {"patch_size": [14, -2]}}, "vision_config.patch_size[1]"),
        ({"max_position_embeddings": 1 << 32}, "max_position_embeddings"),
        ({"rope_scaling": {"factor": math.inf}}, "rope_scaling.factor"),
        ({"head_dim": "128"}, "head_dim"),
        ({"num_experts_per_tok": 2.0}, "num_experts_per_tok"),
    ],
    ids=["zero-width-in-layer-list", "negative-in-list", "context-beyond-2^31", "infinite-float",
         "string-head-dim", "float-top-k"],
)
def test_config_values_no_model_has_are_refused(config, key):
    with pytest.raises(BadInput) as info:
        check_config(config, "config.json")
    assert info.value.one_line().startswith(f"config.json: {key}: ")


@pytest.mark.slow
def test_every_transformers_default_config_passes():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    checked = 0
    for family in CONFIG_MAPPING.keys():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                config = json.loads(CONFIG_MAPPING[family]().to_json_string())
            # a few configs cannot be built without arguments; they are not our concern
            except Exception:
                continue
        check_config(config, f"{family}/config.json")
        checked += 1
    assert checked > 500
