"""Kimi K3's components as registry ops, end to end: the runtime decoder built from the recognized spec of the K3
example release (SiTU-GLU, gated NoPE MLA, block attention residuals, the latent MoE, KDA with the full-rank gate and
bounded decay), with the release's weights, gives the release's own modeling code's logits.

The release's modeling code is this repository's example (onboard/examples/kimi_k3/release_code), run in a
subprocess of its own, so that this process never imports it (test_kimi_k3_example.py checks that of the whole run).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from onboard.package.weight_map import build_weight_map
from onboard.recognize.recognizer import recognize
from onboard.release.manifest import read_manifest
from runtime.model.decoder import HybridDecoder
from runtime.model.weights import load_release
from runtime.spec import DenseFFN

VISION = ("vision_tower.", "mm_projector.")
REPO = Path(__file__).resolve().parents[2]
# the release's logits for the ids in argv[2], its folder argv[1], written to argv[3]: fp32 on its bf16 weights
RELEASE_LOGITS = """
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from onboard.examples.kimi_k3.release_code.configuration_kimi_k3 import KimiK3Config
from onboard.examples.kimi_k3.release_code.modeling_kimi_k3 import KimiK3ForConditionalGeneration
release = Path(sys.argv[1])
model = KimiK3ForConditionalGeneration(KimiK3Config(**json.loads((release / "config.json").read_text()))).float()
state = {}
for shard in sorted(release.glob("*.safetensors")):
    state |= {k: v.float() if v.is_floating_point() else v for k, v in load_file(shard).items()}
missing, unexpected = model.load_state_dict(state, strict=False)
assert not missing and not unexpected, (missing, unexpected)
with torch.no_grad():
    torch.save(model.eval()(input_ids=torch.load(sys.argv[2])).logits, sys.argv[3])
"""


def _spec_and_map(release):
    """The recognized spec and its weight map, with two recognition gaps of the example bridged here (left to the
    recognition side, named in the report): the first layer's dense FFN sits under `mlp.` while the MoE layers'
    is `block_sparse_moe.` (recognized as an own module), and the head is `language_model.lm_head`."""
    manifest = read_manifest(release)
    spec = recognize(manifest)
    text = json.loads((release / "config.json").read_text())["text_config"]
    dense = DenseFFN(intermediate_size=text["intermediate_size"], activation="situ",
                     situ_beta=text["activation_situ_beta"], situ_linear_beta=text["activation_situ_linear_beta"])
    layers = [layer.model_copy(update={"ffn": dense}) if layer.ffn.kind == "own_module" else layer
              for layer in spec.layers]
    spec = spec.model_copy(update={"layers": layers})
    names = set(manifest.tensors)
    weight_map = {}
    for name, entry in build_weight_map(spec).items():
        if name not in names:
            name = name.replace(f".{spec.naming.ffn_module}.", ".mlp.")
        if name not in names and f"language_model.{name}" in names:
            name = f"language_model.{name}"
        weight_map[name] = entry
    return spec, weight_map


def test_runtime_decoder_gives_the_releases_logits(kimi_k3_release, tmp_path):
    release = kimi_k3_release("bf16")
    spec, weight_map = _spec_and_map(release)
    ffns = [layer.ffn for layer in spec.layers]
    attns = [layer.attention for layer in spec.layers]
    # every K3 component recognized as ours, none as an own module
    assert spec.attn_res is not None and spec.attn_res.block_size == json.loads(
        (release / "config.json").read_text())["text_config"]["attn_res_block_size"]
    assert all(f.activation == "situ" and f.situ_betas for f in ffns)
    assert all(f.latent_size and f.latent_norm for f in ffns if f.kind == "moe")
    assert {a.kind for a in attns} == {"kda", "mla"}
    assert all(a.output_gate and a.rope is None for a in attns if a.kind == "mla")
    assert all(a.full_rank_gate and a.gate_lower_bound == -5.0 for a in attns if a.kind == "kda")
    ours = HybridDecoder(spec).float()
    load_release(ours, release, weight_map, skip_prefixes=VISION)
    ids = torch.randint(0, spec.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", RELEASE_LOGITS, str(release), str(tmp_path / "ids.pt"),
                           str(tmp_path / "logits.pt")], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        got, want = ours.eval()(ids), torch.load(tmp_path / "logits.pt")
    # both in fp32 on the same bf16-stored weights: what is left is fp32 summation order (6e-5 seen, logits ~2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-4)
