"""PKG/lora.yaml: written by new-model under the release's module names, read into runtime names."""
from __future__ import annotations

import json

import pytest
import yaml

from runtime.errors import InputFileError
from runtime.lora.plan import read_lora_yaml


def test_new_model_plans_every_attention_projection_by_release_name(example_package):
    pkg = example_package("qwen3_next")
    plan = yaml.safe_load((pkg / "lora.yaml").read_text())
    assert (plan["rank"], plan["alpha"], plan["experts"], plan["router"]) == (16, 32.0, False, False)
    assert "model.layers.*.linear_attn.in_proj_qkvz" in plan["targets"]
    assert "model.layers.*.self_attn.q_proj" in plan["targets"]
    config = read_lora_yaml(pkg / "lora.yaml", json.loads((pkg / "weight_map.json").read_text()))
    # qwen3_next's tiny release: layers 0-2 gated delta, layer 3 softmax attention
    assert "layers.0.attn.in_proj_qkvz" in config.targets and "layers.3.attn.q_proj" in config.targets
    assert "layers.0.attn.q_proj" not in config.targets and config.scale == 2.0


@pytest.mark.parametrize("text, key", [("rank: 0\n", "rank"), ("targets: [model.layers.*.nope]\n", "targets"),
                                       ("ranks: 8\n", "ranks"), ("rank: [\n", None)])
def test_a_bad_lora_yaml_names_its_key(example_package, tmp_path, text, key):
    weight_map = json.loads((example_package("qwen3_next") / "weight_map.json").read_text())
    (tmp_path / "lora.yaml").write_text(text)
    with pytest.raises(InputFileError) as err:
        read_lora_yaml(tmp_path / "lora.yaml", weight_map)
    assert err.value.key == key and "lora.yaml" in err.value.one_line()
