"""`onboard example-model kimi_k3`: a tiny custom-code release of Kimi K3's shape, loadable by transformers with the
release's own code (trust_remote_code=True), in a subprocess: this test process never imports the release's code."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from onboard.release.manifest import read_manifest
from runtime.formats.codec import mxfp4_decode

ROOT = Path(__file__).resolve().parents[2]

# Run in a child: load with the release's code, check nothing was left to init, forward with an image and text,
# backward; print what the parent asserts on.
# The MXFP4 variant's quantization_config is compressed-tensors' form, which from_pretrained hands to the
# compressed-tensors package (not installed here): the child then builds the release's class from its config and
# loads the safetensors itself, strictly, into the release's own MXFP4 modules.
LOAD_FORWARD_BACKWARD = """
import json, sys, torch
from pathlib import Path
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
if sys.argv[2] == "bf16":
    model, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32,
                                                       output_loading_info=True)
else:
    config = AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    state = {k: v for f in sorted(Path(sys.argv[1]).glob("*.safetensors")) for k, v in load_file(f).items()}
    result = model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()},
                                   strict=True)
    info = {"missing_keys": result.missing_keys, "unexpected_keys": result.unexpected_keys}
    model = model.float()
torch.manual_seed(0)
ids = torch.randint(3, 240, (2, 12))
ids[:, 2:6] = model.config.media_placeholder_token_id
out = model(input_ids=ids, pixel_values=torch.randn(2, 3, 16, 16), labels=ids)
out.loss.backward()
grads = {n: p.grad for n, p in model.named_parameters()}
print(json.dumps({"class": type(model).__name__, "module": type(model).__module__, "loss": out.loss.item(),
                  "logits": list(out.logits.shape), "missing": list(info["missing_keys"]),
                  "unexpected": list(info["unexpected_keys"]),
                  "finite": all(bool(g.isfinite().all()) for g in grads.values() if g is not None),
                  "with_grad": sorted(n for n, g in grads.items() if g is not None and bool(g.abs().sum() > 0))}))
"""


@pytest.mark.parametrize("weights", ["bf16", "mxfp4"])
def test_it_loads_with_its_own_code_and_trains(kimi_k3_release, tmp_path, weights):
    release = kimi_k3_release(weights)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", LOAD_FORWARD_BACKWARD, str(release), weights], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["class"] == "KimiK3ForConditionalGeneration" and "modeling_kimi_k3" in got["module"]
    assert got["missing"] == [] and got["unexpected"] == []
    assert got["logits"] == [2, 12, 256] and got["finite"] and 0 < got["loss"] < 20
    trained = set(got["with_grad"])
    # every kind of part takes part: KDA decay, MLA gate, latent MoE, attention residuals, vision tower
    for name in ("language_model.model.layers.0.self_attn.A_log", "language_model.model.layers.3.self_attn.g_proj.weight",
                 "language_model.model.layers.1.block_sparse_moe.routed_expert_up_proj.weight",
                 "language_model.model.layers.1.block_sparse_moe.routed_expert_norm.weight",
                 "language_model.model.layers.2.mlp_res_proj.weight", "language_model.model.output_attn_res_proj.weight",
                 "vision_tower.patch_embed.proj.weight", "mm_projector.proj.2.weight"):
        assert name in trained, name
    # the release's code ran in the child only
    assert not any(name.endswith(("modeling_kimi_k3", "configuration_kimi_k3")) for name in sys.modules)


def test_names_and_dtypes_are_k3s(kimi_k3_release):
    release = kimi_k3_release("bf16")
    manifest = read_manifest(release)
    config = json.loads((release / "config.json").read_text())
    assert set(config["auto_map"].values()) >= {"configuration_kimi_k3.KimiK3Config",
                                                 "modeling_kimi_k3.KimiK3ForConditionalGeneration"}
    assert (release / "modeling_kimi_k3.py").is_file() and (release / "configuration_kimi_k3.py").is_file()
    text = config["text_config"]
    assert text["hidden_act"] == "situ" and text["linear_attn_config"]["kda_layers"] == [1, 2, 3]
    names = set(manifest.tensors)
    assert "language_model.lm_head.weight" in names and "language_model.model.embed_tokens.weight" in names
    assert {n.split(".")[0] for n in names} == {"language_model", "vision_tower", "mm_projector"}
    dtypes = {n: t.dtype for n, t in manifest.tensors.items()}
    assert dtypes["language_model.model.layers.0.self_attn.q_conv1d.weight"] == "F32"
    assert dtypes["language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias"] == "F32"
    assert dtypes["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"] == "BF16"
    a_log = "language_model.model.layers.0.self_attn.A_log"
    with safe_open(release / manifest.tensors[a_log].file, "pt") as f:
        stored = f.get_tensor(a_log)
    heads, width = text["linear_attn_config"]["num_heads"], text["linear_attn_config"]["head_dim"]
    assert stored.shape == (width,) and (stored[heads:] == 0).all() and (stored[:heads] != 0).all()


def test_the_mxfp4_variant_stores_routed_experts_as_released(kimi_k3_release):
    """compressed-tensors' mxfp4-pack-quantized: weight_packed uint8 [out, in/2], weight_scale uint8 [out, in/32];
    everything else as in the bf16 variant."""
    bf16, mxfp4 = read_manifest(kimi_k3_release("bf16")), read_manifest(kimi_k3_release("mxfp4"))
    config = json.loads((kimi_k3_release("mxfp4") / "config.json").read_text())
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    expert = "language_model.model.layers.1.block_sparse_moe.experts.3.w2"
    packed, scale = mxfp4.tensors[f"{expert}.weight_packed"], mxfp4.tensors[f"{expert}.weight_scale"]
    latent, width = 32, 32
    assert (packed.dtype, packed.shape, scale.dtype, scale.shape) == ("U8", (latent, width // 2), "U8", (latent, 1))
    assert f"{expert}.weight" in bf16.tensors and f"{expert}.weight" not in mxfp4.tensors
    others = {n for n in bf16.tensors if ".experts." not in n}
    assert others <= set(mxfp4.tensors) and all(bf16.tensors[n].dtype == mxfp4.tensors[n].dtype for n in others)
    stored = load_file(kimi_k3_release("mxfp4") / packed.file)
    decoded = mxfp4_decode(stored[f"{expert}.weight_packed"], stored[f"{expert}.weight_scale"], torch.float32)
    assert decoded.abs().max() > 0 and decoded.abs().max() < 1
