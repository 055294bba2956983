"""Example releases in the stored weight formats real releases ship, made from the bf16 example.

`onboard example-model F --weights fp8|mxfp4` writes the bf16 example as always, then re-encodes its weights with
runtime/formats/codec.py into the tensors, dtypes and quantization_config of the family's real release, so the bf16
and stored examples of one seed hold the same weights up to quantization:
- deepseek_v3 (DeepSeek-V3/R1): FP8 e4m3 `<m>.weight` + float32 `<m>.weight_scale_inv` per 128x128 block on every
  linear; the embedding, lm_head, the router (`mlp.gate`) and the norms stay unquantized; quantization_config names
  no skipped modules (a weight is quantized exactly when it has a scale).
- deepseek_v32 (DeepSeek-V3.2): as V3 with `scale_fmt: ue8m0` (every scale a power of two, stored as float32); the
  DSA indexer's `wq_b` and `wk` are FP8, its `weights_proj` stays bf16.
- qwen3_next (Qwen3-Next-80B-A3B-*-FP8): bfloat16 scales, as Qwen's FP8 releases store them; quantization_config
  lists the modules left unquantized per layer (norms, the router and shared-expert gate, and the gated-delta
  pieces A_log, conv1d, dt_bias, in_proj_ba, norm); in_proj_qkvz, out_proj and the attention and expert
  projections are FP8.
- gpt_oss (gpt-oss-20b/120b): MXFP4 experts only, `<m>.gate_up_proj_blocks` [E, out, in/32, 16] uint8 +
  `<m>.gate_up_proj_scales` [E, out, in/32] uint8 (E8M0), likewise down_proj; the blocks are stored (out, in) though
  the bf16 experts are (in, out); biases, attention, router, embedding and lm_head stay bf16 as
  quantization_config's modules_to_not_convert says.
Tensors a release keeps unquantized are written as the bf16 example writes them. The FP8 examples are built with
128-row expert and MLP widths (FP8_WIDTHS: gate and up halves of the runtime's fused weight fill whole scale blocks).
"""
from __future__ import annotations

import fnmatch
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from onboard.errors import BadInput
from onboard.examples import WEIGHT_FORMATS
from reference_ops.formats import dequantize_fp8_block, dequantize_mxfp4
from runtime.formats.codec import fp8_block_encode, mxfp4_encode

FP8_BLOCK = (128, 128)
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class StoredRelease:
    """How one family's real release stores its weights in one format. `widths`: config overrides the stored
    example is built with, where the bf16 example's toy widths could not be stored as the release stores them."""
    fmt: str
    quantization_config: Callable[[dict], dict]  # config.json -> the release's quantization_config
    kept: Callable[[dict], list[str]]  # config.json -> modules the release leaves unquantized (patterns, `*` = a part)
    scale_dtype: torch.dtype = torch.float32  # FP8 only
    power_of_two: bool = False  # FP8 only: UE8M0 scales
    widths: tuple[tuple[str, int], ...] = ()

    def quantized(self, name: str, tensor: torch.Tensor, config: dict) -> bool:
        """Whether the release stores this bf16-example tensor in its format: FP8 releases every linear weight,
        gpt-oss's MXFP4 the experts' two projections; less the modules it keeps."""
        if self.fmt == "fp8":
            fits = name.endswith(".weight") and tensor.dim() == 2
        else:
            fits = tensor.dim() == 3 and name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))
        return fits and not _matches(_module(name), self.kept(config))


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _matches(module: str, patterns) -> bool:
    """quantization_config's skip-list rule: an entry names the module or one above it; `*` spans one name part."""
    parts = module.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:n]), p) and p.count(".") == n - 1
               for p in patterns for n in range(1, len(parts) + 1))


# A fused gate/up weight (the runtime's w_gate_up) holds two released FP8 weights, each with its own 128-row scale
# blocks: the halves must fill whole blocks, as real releases' widths do (DeepSeek-V3's experts 2048 rows, its dense
# MLP 18432, Qwen3-Next's experts 512). The toy 32/96-row widths of the bf16 examples would split a block; the FP8
# examples take one 128-row block instead (a split off the grid is a gap: onboard/package/weight_map.py).
FP8_WIDTHS = (("intermediate_size", 128), ("moe_intermediate_size", 128), ("shared_expert_intermediate_size", 128))
_FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(FP8_BLOCK)}
# DeepSeek's FP8 releases list nothing: these are the linears their inference code builds in bf16/fp32 (a weight is
# quantized exactly when it has a scale)
_DEEPSEEK_KEPT = ["model.embed_tokens", "lm_head", "model.layers.*.mlp.gate", "model.layers.*.self_attn.indexer.weights_proj"]


def _deepseek(scale_fmt: str | None) -> StoredRelease:
    extra = {"scale_fmt": scale_fmt} if scale_fmt else {}
    return StoredRelease("fp8", lambda config: dict(_FP8_CONFIG, **extra), lambda config: _DEEPSEEK_KEPT,
                         power_of_two=scale_fmt == "ue8m0", widths=FP8_WIDTHS)


def _qwen3_next_skipped(config: dict) -> list[str]:
    """Qwen3-Next-FP8's modules_to_not_convert: lm_head, then per layer in order its norms, router, shared-expert
    gate and (by layer kind) the gated-delta pieces or the q/k norms."""
    skipped = ["lm_head"]
    for i, kind in enumerate(config["layer_types"]):
        mixer = (["linear_attn.A_log", "linear_attn.conv1d", "linear_attn.dt_bias", "linear_attn.in_proj_ba",
                  "linear_attn.norm"] if kind == "linear_attention" else ["self_attn.k_norm", "self_attn.q_norm"])
        parts = ["input_layernorm", "mlp.gate", "mlp.shared_expert_gate", "post_attention_layernorm"] + mixer
        skipped += [f"model.layers.{i}.{p}" for p in sorted(parts)]
    return skipped


def _qwen3_next() -> StoredRelease:
    # the list leaves out the embedding, which no FP8 loader converts
    return StoredRelease("fp8", lambda config: dict(_FP8_CONFIG, modules_to_not_convert=_qwen3_next_skipped(config)),
                         lambda config: ["model.embed_tokens"] + _qwen3_next_skipped(config), scale_dtype=torch.bfloat16,
                         widths=FP8_WIDTHS)


_GPT_OSS_SKIPPED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _gpt_oss() -> StoredRelease:
    return StoredRelease("mxfp4", lambda config: {"modules_to_not_convert": list(_GPT_OSS_SKIPPED),
                                                  "quant_method": "mxfp4"}, lambda config: _GPT_OSS_SKIPPED)


RELEASES: dict[tuple[str, str], StoredRelease] = {
    ("deepseek_v3", "fp8"): _deepseek(None),
    ("deepseek_v32", "fp8"): _deepseek("ue8m0"),
    ("qwen3_next", "fp8"): _qwen3_next(),
    ("gpt_oss", "mxfp4"): _gpt_oss(),
}


def stored_release(family: str, weights: str) -> StoredRelease:
    """The release format, or BadInput naming --weights when the family does not ship in it."""
    if weights not in WEIGHT_FORMATS:
        raise BadInput(None, "--weights", f"expected one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    release = RELEASES.get((family, weights))
    if release is None:
        shipped = sorted(fmt for fam, fmt in RELEASES if fam == family)
        raise BadInput(None, "--weights", f"{family} releases do not ship {weights} weights; its example is written "
                                          f"in {', '.join(['bf16'] + shipped)}")
    return release


def encode_release(out_dir: Path, release: StoredRelease) -> None:
    """Re-encode the bf16 release in out_dir in place: shards, index and config.json."""
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    renamed: dict[str, dict[str, str]] = {}
    for shard in sorted(out_dir.glob("*.safetensors")):
        tensors = load_file(shard)
        stored: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            encoded = _encode(name, tensor, release) if release.quantized(name, tensor, config) else {name: tensor}
            stored.update(encoded)
            renamed[name] = {key: shard.name for key in encoded}
        save_file(stored, shard, metadata={"format": "pt"})
    _rewrite_index(out_dir, renamed)
    config["quantization_config"] = release.quantization_config(config)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _encode(name: str, tensor: torch.Tensor, release: StoredRelease) -> dict[str, torch.Tensor]:
    if release.fmt == "fp8":
        codes, scale = fp8_block_encode(tensor, FP8_BLOCK, release.power_of_two, release.scale_dtype)
        return {name: codes, f"{_module(name)}.weight_scale_inv": scale.contiguous()}
    # gpt-oss experts are [E, in, out] in bf16; the MXFP4 blocks group 32 inputs of one output row
    packed, scales = mxfp4_encode(tensor.transpose(-1, -2))
    return {f"{name}_blocks": packed.unflatten(-1, (-1, 16)).contiguous(), f"{name}_scales": scales.contiguous()}


def _rewrite_index(out_dir: Path, renamed: dict[str, dict[str, str]]) -> None:
    index_path = out_dir / INDEX_FILE
    if not index_path.exists():
        return
    index = json.loads(index_path.read_text())
    weight_map = {}
    for name in index["weight_map"]:
        weight_map.update(renamed[name])
    index["weight_map"] = dict(sorted(weight_map.items()))
    index.setdefault("metadata", {})["total_size"] = sum(_tensor_bytes(p) for p in out_dir.glob("*.safetensors"))
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _tensor_bytes(shard: Path) -> int:
    """Bytes of tensor data in a shard (its size less the header), as the index's total_size counts them."""
    with shard.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    return shard.stat().st_size - 8 - header_len


def decoded_tensors(tensors: dict[str, torch.Tensor], quantization_config: dict) -> dict[str, torch.Tensor]:
    """The inverse of the encoding, with the fp64 reference decoders and the block size quantization_config states:
    a stored release's tensors under the names and layout a bf16 release uses (scale tensors consumed), fp64 where
    decoded, the rest as stored."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith((".weight_scale_inv", "_scales")):
            continue
        if name.endswith("_blocks"):
            packed = tensor.flatten(-2)
            out[name.removesuffix("_blocks")] = dequantize_mxfp4(packed, tensors[name[:-len("_blocks")] + "_scales"]
                                                                 ).transpose(-1, -2)
        elif f"{_module(name)}.weight_scale_inv" in tensors:
            block = tuple(quantization_config["weight_block_size"])
            out[name] = dequantize_fp8_block(tensor, tensors[f"{_module(name)}.weight_scale_inv"], block)
        else:
            out[name] = tensor
    return out


def write_decoded_release(stored_dir: Path, out: Path) -> Path:
    """The stored release decoded by decoded_tensors (fp64 reference, block size from quantization_config), written
    in fp32 under the bf16 release's names and layout, quantization_config dropped: a release transformers and
    the bf16 weight map load without a quantizer (the truth the stored-format paths are compared with)."""
    stored_dir, out = Path(stored_dir), Path(out)
    config = json.loads((stored_dir / "config.json").read_text())
    quantization_config = config.pop("quantization_config")
    shutil.copytree(stored_dir, out)
    weight_map = {}
    for shard in sorted(out.glob("*.safetensors")):
        decoded = decoded_tensors(load_file(shard), quantization_config)
        save_file({k: v.float().contiguous() for k, v in decoded.items()}, shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(decoded, shard.name))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (out / INDEX_FILE).exists():
        index = json.loads((out / INDEX_FILE).read_text())
        (out / INDEX_FILE).write_text(json.dumps(dict(index, weight_map=weight_map), indent=2) + "\n")
    return out
