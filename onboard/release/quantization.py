"""quantization_config -> the release's stored format, each quantized weight paired with its scale tensors.

Formats read (the key names transformers' FineGrainedFP8Config / Mxfp4Config and compressed-tensors write):
  fp8 (DeepSeek-V3/V3.2, Qwen3-Next-FP8): quant_method "fp8", weight_block_size [rows, cols], optional scale_fmt
      "ue8m0" (power-of-two scales); `<m>.weight` float8_e4m3fn [.., O, I] + `<m>.weight_scale_inv`
      [.., ceil(O/rows), ceil(I/cols)] float32 or float8_e8m0fnu.
  mxfp4 (gpt-oss): quant_method "mxfp4"; `<m>_blocks` [.., O, G, 16] uint8 + `<m>_scales` [.., O, G] uint8.
  compressed-tensors whose config groups are all "mxfp4-pack-quantized" (Kimi K3's experts): `<m>.weight_packed`
      [.., O, I/2] uint8 + `<m>.weight_scale` [.., O, I/32] uint8 (+ `<m>.weight_shape`, the logical shape).
Modules the config keeps unquantized: `modules_to_not_convert` (globs, `*` one name part) or compressed-tensors'
`ignore` (names, or regexes after "re:").

A pairing the files contradict (a scale without its weight or the reverse, a scale grid the stated block size
does not tile, a quantized tensor in a module the config keeps unquantized) is bad input naming both tensors; a
format we do not support yet (INT4 compressed-tensors, NVFP4, static FP8 activations) is a gap naming it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from onboard.errors import BadInput
from onboard.release.config_view import NotRecognized
from runtime.formats.scheme import MXFP4, FP8Block, StoredEntry, StoredFormat

KEY = "quantization_config"
FP8_SCALE = ".weight_scale_inv"
FP8_CODES_DTYPE = "F8_E4M3"
FP8_SCALE_DTYPES = ("F32", "F8_E8M0", "BF16")
BLOCKS, SCALES = "_blocks", "_scales"
PACKED, PACKED_SCALE, PACKED_SHAPE = ".weight_packed", ".weight_scale", ".weight_shape"
MXFP4_GROUP = 32
MXFP4_PACKED_FORMAT = "mxfp4-pack-quantized"
# what compressed-tensors' formats hold, to name a gap
COMPRESSED_NAMES = {"pack-quantized": "INT4/INT8 weights packed in int32 (pack-quantized)",
                    "nvfp4-pack-quantized": "NVFP4", "float-quantized": "FP8 per-channel (float-quantized)",
                    "int-quantized": "INT8 (int-quantized)", "naive-quantized": "naive-quantized",
                    "mxfp8-quantized": "MXFP8", "marlin-24": "Marlin 2:4 sparse INT4", "dense": "dense (not quantized)"}
# safetensors dtype of a logical weight, from the config's dtype
LOGICAL_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@dataclass(frozen=True)
class QuantizedRelease:
    """What quantization_config says, checked against the tensors, and the logical view it gives."""
    format: StoredFormat
    not_converted: tuple[str, ...]  # the config's patterns of modules kept unquantized, as written
    stored: dict[str, StoredEntry]  # logical name -> codes and scale tensors
    hidden: frozenset[str]  # released names the logical view drops (scales, codes renamed, weight_shape)
    logical_shapes: dict[str, Optional[tuple[int, ...]]] = field(default_factory=dict)  # None: index alone

    @property
    def label(self) -> str:
        return format_label(self.format)


def format_label(fmt: StoredFormat) -> str:
    """How reports name a stored format."""
    if isinstance(fmt, FP8Block):
        scales = ", power-of-two scales" if fmt.power_of_two else ""
        return f"FP8 e4m3 ({fmt.block[0]}x{fmt.block[1]} blocks{scales})"
    return "MXFP4 (gpt-oss blocks)" if fmt.layout == "blocks" else "MXFP4 (compressed-tensors packed)"


def quantization_config(config: dict, text_config: dict) -> Optional[dict]:
    """The release's quantization_config (top level, else the text part's); None when it ships unquantized."""
    for part in (config, text_config):
        if part.get(KEY) is not None:
            return part[KEY]
    return None


def read_quantization(config: dict, text_config: dict, tensors: dict, config_path: Path) -> Optional[QuantizedRelease]:
    """The release's stored format with every quantized weight paired with its scales; None when not quantized.
    `tensors`: released name -> TensorInfo (dtype and shape None when only the index is on disk)."""
    qc = quantization_config(config, text_config)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise BadInput(config_path, KEY, f"must be an object, got {type(qc).__name__}")
    fmt = stored_format(qc, config_path)
    not_converted = _not_converted(qc, config_path)
    pair = {FP8Block: _pair_fp8, MXFP4: _pair_mxfp4_blocks if getattr(fmt, "layout", "") == "blocks"
            else _pair_mxfp4_packed}[type(fmt)]
    stored, hidden, shapes = pair(fmt, tensors, config_path.parent)
    _check_not_converted(stored, not_converted, config_path)
    return QuantizedRelease(fmt, not_converted, stored, frozenset(hidden), shapes)


# ---- the format


def stored_format(qc: dict, config_path: Path) -> StoredFormat:
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_format(qc, config_path)
    if method == "mxfp4":
        return MXFP4(layout="blocks")
    if method == "compressed-tensors":
        return _compressed_format(qc, config_path)
    # NVIDIA ModelOpt releases name the algorithm (NVFP4, FP8) beside or under their method
    nested = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else {}
    algo = qc.get("quant_algo") or nested.get("quant_algo")
    named = f"{method!r}" + (f" ({algo})" if algo else "")
    raise NotRecognized(f"{KEY}.quant_method", f"weights stored as {named} are not supported yet "
                        "(read: fp8 block-scaled, mxfp4, compressed-tensors mxfp4-pack-quantized)")


def _fp8_format(qc: dict, config_path: Path) -> FP8Block:
    block = qc.get("weight_block_size")
    if block is None:
        raise NotRecognized(f"{KEY}.weight_block_size", "FP8 without a block size (per-tensor scales) is not "
                            "supported yet; block-scaled FP8 is")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise BadInput(config_path, f"{KEY}.weight_block_size", f"expected [rows, cols] of positive integers, got {block!r:.60}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise NotRecognized(f"{KEY}.activation_scheme", f"FP8 with {qc['activation_scheme']!r} activation scales "
                            "is not supported yet (dynamic is)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise NotRecognized(f"{KEY}.fmt", f"FP8 codes in {qc['fmt']!r} are not supported yet (e4m3 is)")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise NotRecognized(f"{KEY}.scale_fmt", f"FP8 scales in {scale_fmt!r} are not supported yet (float32, ue8m0 are)")
    return FP8Block(block=tuple(block), power_of_two=scale_fmt == "ue8m0")


def _compressed_format(qc: dict, config_path: Path) -> MXFP4:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise BadInput(config_path, f"{KEY}.config_groups", "compressed-tensors needs a non-empty object of groups")
    for name, group in groups.items():
        where = f"{KEY}.config_groups.{name}"
        if not isinstance(group, dict):
            raise BadInput(config_path, where, f"must be an object, got {type(group).__name__}")
        fmt = group.get("format") or qc.get("format")
        if fmt != MXFP4_PACKED_FORMAT:
            what = COMPRESSED_NAMES.get(fmt, repr(fmt)) if isinstance(fmt, str) else repr(fmt)
            raise NotRecognized(f"{where}.format", f"compressed-tensors {what} weights are not supported yet "
                                f"(read: {MXFP4_PACKED_FORMAT})")
        weights = group.get("weights") or {}
        if not isinstance(weights, dict):
            raise BadInput(config_path, f"{where}.weights", f"must be an object, got {type(weights).__name__}")
        if (weights.get("num_bits"), weights.get("type"), weights.get("group_size")) != (4, "float", MXFP4_GROUP):
            raise BadInput(config_path, f"{where}.weights", f"format {MXFP4_PACKED_FORMAT} means 4-bit float weights in "
                           f"groups of {MXFP4_GROUP}, got num_bits={weights.get('num_bits')!r} type="
                           f"{weights.get('type')!r} group_size={weights.get('group_size')!r}")
    return MXFP4(layout="packed")


def _not_converted(qc: dict, config_path: Path) -> tuple[str, ...]:
    patterns = []
    for key in ("modules_to_not_convert", "ignore"):
        value = qc.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise BadInput(config_path, f"{KEY}.{key}", f"expected a list of module names, got {value!r:.60}")
        patterns += value
    return tuple(patterns)


def module_pattern(pattern: str) -> re.Pattern:
    """A not-converted entry as a regex over module names: "re:REGEX" as written (matched from the start, as
    compressed-tensors does); else a name or glob (`*` one name part, as gpt-oss writes "model.layers.*.self_attn")
    covering the module and everything under it."""
    if pattern.startswith("re:"):
        return re.compile(pattern[3:])
    return re.compile(re.escape(pattern).replace(r"\*", r"[^.]+") + r"(\.|$)")


def _compiled(pattern: str, config_path: Path) -> re.Pattern:
    try:
        return module_pattern(pattern)
    except re.error as err:
        raise BadInput(config_path, KEY, f"not-converted pattern {pattern!r} is not a valid regex ({err})") from None


def _check_not_converted(stored: dict[str, StoredEntry], patterns: tuple[str, ...], config_path: Path) -> None:
    compiled = [(p, _compiled(p, config_path)) for p in patterns]
    for entry in stored.values():
        module = entry.codes.rsplit(".", 1)[0]
        for pattern, rx in compiled:
            if rx.match(module):
                raise BadInput(config_path, f"{KEY} not-converted {pattern!r}", f"covers {entry.codes}, which is "
                               f"stored quantized with {entry.scale}")


# ---- pairing codes with scales


def _missing(root: Path, present: str, absent: str, tensors: dict, what: str) -> BadInput:
    return BadInput(root / (tensors[present].file or ""), present, f"{what}; {absent} is missing from the release")


def _pair_fp8(fmt: FP8Block, tensors: dict, root: Path):
    stored, hidden, shapes = {}, set(), {}
    for name in tensors:
        if name.endswith(FP8_SCALE):
            codes = name[: -len(FP8_SCALE)] + ".weight"
            if codes not in tensors:
                raise _missing(root, name, codes, tensors, "a block scale without its weight")
            _check_fp8(fmt, tensors[codes], tensors[name], root)
            stored[codes] = StoredEntry(format=fmt, codes=codes, scale=name)
            shapes[codes] = tensors[codes].shape
            hidden.add(name)
        elif tensors[name].dtype == FP8_CODES_DTYPE and name.endswith(".weight") \
                and name[: -len(".weight")] + FP8_SCALE not in tensors:
            raise _missing(root, name, name[: -len(".weight")] + FP8_SCALE, tensors, "an FP8 weight without its block scale")
    return stored, hidden, shapes


def _check_fp8(fmt: FP8Block, codes, scale, root: Path) -> None:
    if codes.dtype is None or scale.dtype is None:
        return  # the index alone: paired by name
    where = root / (scale.file or "")
    if codes.dtype != FP8_CODES_DTYPE:
        raise BadInput(where, scale.name, f"a block scale for {codes.name}, which is {codes.dtype}, not "
                       f"{FP8_CODES_DTYPE} codes")
    if scale.dtype not in FP8_SCALE_DTYPES:
        raise BadInput(where, scale.name, f"dtype {scale.dtype}; the block scales of {codes.name} must be one of "
                       f"{', '.join(FP8_SCALE_DTYPES)}")
    if len(codes.shape) < 2:
        raise BadInput(where, codes.name, f"shape {codes.shape} has no rows and columns to scale by {scale.name}")
    *lead, rows, cols = codes.shape
    grid = (*lead, math.ceil(rows / fmt.block[0]), math.ceil(cols / fmt.block[1]))
    if tuple(scale.shape) != grid:
        raise BadInput(where, scale.name, f"shape {tuple(scale.shape)} does not match {codes.name} "
                       f"{tuple(codes.shape)} in the {fmt.block[0]}x{fmt.block[1]} blocks quantization_config."
                       f"weight_block_size states (expected {grid})")


def _pair_mxfp4_blocks(fmt: MXFP4, tensors: dict, root: Path):
    stored, hidden, shapes = {}, set(), {}
    for name in tensors:
        if name.endswith(SCALES) and name[: -len(SCALES)] + BLOCKS not in tensors:
            raise _missing(root, name, name[: -len(SCALES)] + BLOCKS, tensors, "MXFP4 scales without their blocks")
        if not name.endswith(BLOCKS):
            continue
        logical = name[: -len(BLOCKS)]
        scale = logical + SCALES
        if scale not in tensors:
            raise _missing(root, name, scale, tensors, "MXFP4 blocks without their scales")
        shapes[logical] = _check_blocks(tensors[name], tensors[scale], root)
        stored[logical] = StoredEntry(format=fmt, codes=name, scale=scale)
        hidden |= {name, scale}
    return stored, hidden, shapes


def _check_blocks(blocks, scales, root: Path) -> Optional[tuple[int, ...]]:
    """The logical shape: gpt-oss's bf16 release stores its experts [.., in, out] (x @ W), the transpose of the
    decoded [.., out, in]; None from the index alone."""
    if blocks.shape is None or scales.shape is None:
        return None
    where = root / (blocks.file or "")
    if blocks.dtype != "U8" or len(blocks.shape) < 3 or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise BadInput(where, blocks.name, f"{blocks.dtype} {blocks.shape}; MXFP4 blocks are U8 [.., O, G, "
                       f"{MXFP4_GROUP // 2}] beside {scales.name}")
    if scales.dtype != "U8" or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise BadInput(root / (scales.file or ""), scales.name, f"{scales.dtype} {tuple(scales.shape)} does not "
                       f"scale {blocks.name} {tuple(blocks.shape)} (expected U8 {tuple(blocks.shape[:-1])})")
    *lead, rows, groups, _ = blocks.shape
    return (*lead, groups * MXFP4_GROUP, rows)


def _pair_mxfp4_packed(fmt: MXFP4, tensors: dict, root: Path):
    stored, hidden, shapes = {}, set(), {}
    for name in tensors:
        for companion in (PACKED_SCALE, PACKED_SHAPE):
            if name.endswith(companion) and name[: -len(companion)] + PACKED not in tensors:
                raise _missing(root, name, name[: -len(companion)] + PACKED, tensors, "a packed weight's companion without its codes")
        if not name.endswith(PACKED):
            continue
        module = name[: -len(PACKED)]
        scale = module + PACKED_SCALE
        if scale not in tensors:
            raise _missing(root, name, scale, tensors, "MXFP4 packed codes without their scale")
        shapes[module + ".weight"] = _check_packed(tensors[name], tensors[scale], root)
        stored[module + ".weight"] = StoredEntry(format=fmt, codes=name, scale=scale)
        # compressed-tensors writes a weight_shape beside the codes; a release without one hides none
        hidden |= {name, scale} | ({module + PACKED_SHAPE} & tensors.keys())
    return stored, hidden, shapes


def _check_packed(packed, scale, root: Path) -> Optional[tuple[int, ...]]:
    if packed.shape is None or scale.shape is None:
        return None
    where = root / (packed.file or "")
    if packed.dtype != "U8" or len(packed.shape) < 2:
        raise BadInput(where, packed.name, f"{packed.dtype} {packed.shape}; MXFP4 packed codes are U8 [.., O, I/2] "
                       f"beside {scale.name}")
    *lead, rows, half = packed.shape
    expected = (*lead, rows, 2 * half // MXFP4_GROUP)
    if scale.dtype != "U8" or tuple(scale.shape) != expected or (2 * half) % MXFP4_GROUP:
        raise BadInput(root / (scale.file or ""), scale.name, f"{scale.dtype} {tuple(scale.shape)} does not scale "
                       f"{packed.name} {tuple(packed.shape)} in groups of {MXFP4_GROUP} (expected U8 {expected})")
    return (*lead, rows, 2 * half)


# ---- the logical view and its bytes


def logical_dtype(config: dict, text_config: dict) -> str:
    """The dtype a bf16 release of the family stores its weights in (the config's), as safetensors names it."""
    for part in (config, text_config):
        name = part.get("dtype") or part.get("torch_dtype")
        if name in LOGICAL_DTYPES:
            return LOGICAL_DTYPES[name]
    return "BF16"


def stored_bytes(fmt: StoredFormat, shape: tuple[int, ...], scale_bytes: int = 4) -> int:
    """Bytes of codes and scales of one weight of logical `shape` (for the blocks layout, [.., in, out])."""
    numel = math.prod(shape)
    if isinstance(fmt, MXFP4):
        # half a byte per e2m1 code, one E8M0 byte per 32
        return numel // 2 + numel // MXFP4_GROUP
    *lead, rows, cols = shape
    blocks = math.prod(lead) * math.ceil(rows / fmt.block[0]) * math.ceil(cols / fmt.block[1])
    return numel + scale_bytes * blocks
