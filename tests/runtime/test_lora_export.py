"""`onboard export`: the PEFT adapter loaded by real transformers + peft, and the merged release loaded
by real transformers, reproduce the runtime adapter model's logits; the merged release keeps the
release's files, names, shards and dtypes. On a linear-attention, a DSA, a multimodal and a classic MoE family.
A run that updated the routers' correction biases (glm4_moe): --peft refuses, --merge carries the biases."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from onboard import cli
from onboard.align.reference import load_reference, load_runtime
from onboard.package.export import write_merged
from onboard.package.reader import read_package
from runtime.lora.factors import apply_lora, lora_parameters, lora_state_dict
from runtime.lora.plan import read_lora_yaml
from runtime.tolerances import compare, tolerance_for
from runtime.train import balance
from runtime.train.run_folder import read_adapter, read_biases, save_adapter, write_run_json

FAMILIES = ["qwen3_next", "deepseek_v32", "qwen3_5_moe", "mixtral"]


def _trained_run(example_package, family: str, run, biases: bool = False):
    """A run folder whose adapter has nonzero factors everywhere (dense targets of lora.yaml and the experts);
    with biases, the routers' correction biases moved too, as a run with --bias-update-rate leaves them."""
    pkg = example_package(family)
    inputs = read_package(pkg)
    spec, weight_map, source = inputs.spec, inputs.weight_map, inputs.source
    model = load_runtime(spec, weight_map, source, torch.float32)
    config = dataclasses.replace(read_lora_yaml(pkg / "lora.yaml", weight_map), rank=4, alpha=8.0,
                                 experts=any(layer["ffn"]["kind"] == "moe" for layer in spec["layers"]))
    apply_lora(model, config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        for bias_E in balance.correction_biases(model).values() if biases else ():
            bias_E += torch.randn(bias_E.shape, generator=gen)
    write_run_json(run, pkg, source)
    save_adapter(run, lora_state_dict(model), config, balance.bias_state_dict(model) if biases else None)
    ids = torch.randint(0, spec["vocab_size"], (2, 12), generator=gen)
    with torch.no_grad():
        return model(ids), ids, spec, source


def _assert_logits(actual, expected):
    c = compare(actual.float(), expected, tolerance_for("model_logits", torch.float32))
    assert c.finite and c.max_abs_rel <= c.tolerance.max_abs_rel, c


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_export_loads_in_transformers_and_peft(example_package, family, tmp_path):
    from peft import PeftModel

    expected, ids, spec, source = _trained_run(example_package, family, tmp_path / "run")
    assert cli.main(["export", str(tmp_path / "run"), "--peft", str(tmp_path / "peft")]) == 0
    adapter = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == 4 and adapter["target_modules"]
    assert any(name.endswith("experts.gate_up_proj") for name in adapter["target_parameters"])
    model = PeftModel.from_pretrained(load_reference(source, spec["family"], torch.float32), tmp_path / "peft").eval()
    with torch.no_grad():
        _assert_logits(model(input_ids=ids, use_cache=False).logits, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_export_loads_in_transformers(example_package, family, tmp_path):
    expected, ids, spec, source = _trained_run(example_package, family, tmp_path / "run")
    config, state = read_adapter(tmp_path / "run")
    exact = tmp_path / "merged_fp32"
    exact.mkdir()
    write_merged(exact, source, json.loads((example_package(family) / "weight_map.json").read_text()), state,
                 config.scale, dtype=torch.float32)
    with torch.no_grad():
        _assert_logits(load_reference(exact, spec["family"], torch.float32)(input_ids=ids, use_cache=False).logits, expected)
    # as users get it: the release's own files, tensor names, shards and dtypes, the fp32 merge rounded once
    assert cli.main(["export", str(tmp_path / "run"), "--merge", str(tmp_path / "merged")]) == 0
    files = sorted(p.name for p in source.iterdir())
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == files
    assert (tmp_path / "merged" / "config.json").read_text() == (source / "config.json").read_text()
    for shard in source.glob("*.safetensors"):
        with safe_open(shard, "pt") as ours, safe_open(tmp_path / "merged" / shard.name, "pt") as merged, \
                safe_open(exact / shard.name, "pt") as fp32:
            assert sorted(merged.keys()) == sorted(ours.keys())
            for name in ours.keys():
                released = ours.get_tensor(name)
                assert torch.equal(merged.get_tensor(name), fp32.get_tensor(name).to(released.dtype)), name


def test_updated_correction_biases_go_into_the_merge_only(example_package, tmp_path, capsys):
    expected, ids, spec, source = _trained_run(example_package, "glm4_moe", tmp_path / "run", biases=True)
    assert cli.main(["export", str(tmp_path / "run"), "--peft", str(tmp_path / "peft")]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "correction bias" in err and "--merge" in err
    assert not (tmp_path / "peft").exists()
    config, state = read_adapter(tmp_path / "run")
    weight_map = json.loads((example_package("glm4_moe") / "weight_map.json").read_text())
    for with_biases, name in ((False, "factors_only"), (True, "merged_fp32")):
        (tmp_path / name).mkdir()
        write_merged(tmp_path / name, source, weight_map, state, config.scale, dtype=torch.float32,
                     biases=read_biases(tmp_path / "run") if with_biases else None)
        with torch.no_grad():
            logits = load_reference(tmp_path / name, "glm4_moe", torch.float32)(input_ids=ids, use_cache=False).logits
        if with_biases:
            _assert_logits(logits, expected)
        else:
            # the factors alone route as the release did: the moved biases change the logits
            assert not torch.allclose(logits, expected, atol=1e-3)
    assert cli.main(["export", str(tmp_path / "run"), "--merge", str(tmp_path / "merged")]) == 0


def test_export_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path / "nothing"), "--peft", str(tmp_path / "out")]) == 2
    assert "run.json" in capsys.readouterr().err
