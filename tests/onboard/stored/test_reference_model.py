"""Tiers 1-2's reference of a stored-format release (onboard/align/reference.py load_reference): transformers' class
built without the quantizer and loaded with our fp64 decodes. Where transformers' own dequantizing load works, both
hold the same weights exactly; where it does not (DeepSeek-V3's kv_a_proj_with_mqa rows end in a partial block:
32 + 8 = 40 rows in 16-row blocks here, 576 in 128-row blocks in the real release), ours holds what transformers
loads from a plain release of the decoded weights."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from onboard.align.reference import load_reference
from onboard.align.stored import reference_state_dict
from onboard.release.manifest import read_manifest
from onboard.release.transformers_classes import model_class
from tests.onboard.formats.stored_release import fp8_release, mxfp4_release


def _equal_state(ours, theirs) -> None:
    a, b = ours.state_dict(), theirs.state_dict()
    assert set(a) == set(b)
    assert [k for k in a if not torch.equal(a[k], b[k].to(a[k].dtype))] == []


@pytest.mark.parametrize("family", ["qwen3_next", "gpt_oss"])
def test_reference_holds_what_transformers_dequantizing_load_holds(family, example_release, tmp_path):
    from transformers import FineGrainedFP8Config, Mxfp4Config

    if family == "gpt_oss":
        release, qc = mxfp4_release(example_release(family), tmp_path / family), Mxfp4Config(dequantize=True)
    else:
        release = fp8_release(example_release(family), tmp_path / family)
        qc = FineGrainedFP8Config(weight_block_size=(16, 16), dequantize=True)
    theirs = model_class(family).from_pretrained(release, quantization_config=qc, dtype=torch.float32,
                                                 trust_remote_code=False)
    _equal_state(load_reference(release, family, torch.float32), theirs)


def test_deepseek_v3_partial_block_rows_load_as_a_plain_release_of_the_decoded_weights(example_release, tmp_path):
    from transformers import FineGrainedFP8Config

    release = fp8_release(example_release("deepseek_v3"), tmp_path / "fp8")
    # transformers' own path takes the block from the scale grid: 40 rows over 3 scale rows does not divide
    with pytest.raises(Exception):
        model_class("deepseek_v3").from_pretrained(release, dtype=torch.float32, trust_remote_code=False,
                                                   quantization_config=FineGrainedFP8Config(weight_block_size=(16, 16),
                                                                                            dequantize=True))
    plain = tmp_path / "decoded"
    plain.mkdir()
    save_file(reference_state_dict(read_manifest(release), torch.float32), str(plain / "model.safetensors"))
    config = json.loads((release / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    theirs = model_class("deepseek_v3").from_pretrained(plain, dtype=torch.float32, trust_remote_code=False)
    ours = load_reference(release, "deepseek_v3", torch.float32)
    _equal_state(ours, theirs)
    kv = ours.model.layers[0].self_attn.kv_a_proj_with_mqa.weight
    assert kv.shape[0] % 16 and kv.shape[0] > 32
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)


def test_a_prefix_reads_only_its_layers(example_release, tmp_path):
    release = fp8_release(example_release("deepseek_v3"), tmp_path / "fp8")
    state = reference_state_dict(read_manifest(release), torch.bfloat16, num_layers=1)
    assert not any(".layers.1." in name for name in state)
    assert not any(name.endswith("_scale_inv") for name in state)
    assert state["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
