"""Stored-format releases for the tests: a bf16 example release (real safetensors from transformers' save_pretrained)
re-encoded with runtime/formats/codec.py and written as the real releases lay out their tensors and configs.

  fp8:    every 2-D projection of the layers (DeepSeek-V3 keeps its router, norms, embedding and head bf16) as
          float8_e4m3fn `.weight` + float32 `.weight_scale_inv`, quant_method "fp8" with weight_block_size.
  mxfp4:  gpt-oss experts as `<name>_blocks` [E, out, G, 16] + `<name>_scales` [E, out, G], quant_method "mxfp4".
  packed: per-expert projections as compressed-tensors mxfp4-pack-quantized `weight_packed` + `weight_scale`.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from runtime.formats.codec import fp8_block_encode, mxfp4_encode

FP8_SKIP = re.compile(r"layernorm|norm\.weight$|mlp\.gate\.weight$|embed_tokens|lm_head")
GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.\w+\.weight$")


def _tensors(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(src.glob("*.safetensors")):
        out |= load_file(str(file))
    return out


def _write(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quantization_config: dict) -> Path:
    dst.mkdir(parents=True)
    for file in src.iterdir():
        if not file.name.endswith(".safetensors") and file.name != "model.safetensors.index.json":
            shutil.copy(file, dst / file.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def fp8_release(src: Path, dst: Path, block=(16, 16), power_of_two: bool = False) -> Path:
    tensors = {}
    for name, t in _tensors(src).items():
        if t.dim() == 2 and name.endswith(".weight") and ".layers." in name and not FP8_SKIP.search(name):
            codes, scale = fp8_block_encode(t, block, power_of_two)
            tensors[name], tensors[name[: -len(".weight")] + ".weight_scale_inv"] = codes, scale
        else:
            tensors[name] = t
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
    if power_of_two:
        qc["scale_fmt"] = "ue8m0"
    return _write(src, dst, tensors, qc)


def mxfp4_release(src: Path, dst: Path) -> Path:
    tensors = {}
    for name, t in _tensors(src).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # gpt-oss's bf16 experts are [E, in, out]; the blocks hold the [E, out, in] weight
            packed, scales = mxfp4_encode(t.transpose(-1, -2))
            tensors[name + "_blocks"] = packed.unflatten(-1, (-1, 16))
            tensors[name + "_scales"] = scales
        else:
            tensors[name] = t
    return _write(src, dst, tensors, {"modules_to_not_convert": GPT_OSS_NOT_CONVERTED, "quant_method": "mxfp4"})


def packed_release(src: Path, dst: Path) -> Path:
    tensors = {}
    for name, t in _tensors(src).items():
        if EXPERT_WEIGHT.search(name):
            module = name[: -len(".weight")]
            tensors[module + ".weight_packed"], tensors[module + ".weight_scale"] = mxfp4_encode(t)
            tensors[module + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int32)
        else:
            tensors[name] = t
    group = {"format": "mxfp4-pack-quantized", "targets": ["Linear"], "input_activations": None,
             "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True}}
    qc = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": group},
          "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.gate$"]}
    return _write(src, dst, tensors, qc)


def edit_tensors(release: Path, edit) -> None:
    """Rewrite the release as one model.safetensors with `edit(tensors)` applied (tampering)."""
    tensors = _tensors(release)
    edit(tensors)
    for file in list(release.glob("*.safetensors")) + list(release.glob("model.safetensors.index.json")):
        file.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(release / "model.safetensors"))


def edit_config(release: Path, edit) -> None:
    path = release / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))
