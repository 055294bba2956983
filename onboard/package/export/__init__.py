"""`onboard export RUN --peft DIR | --merge DIR [--requantize]`: a trained adapter in PEFT's format, or merged weights.

--peft writes adapter_config.json + adapter_model.safetensors under the transformers module names
of the release (onboard/package/peft_format.py). --merge writes the release again with every LoRA delta
added to its weight, under the release's own tensor names, dtypes and shard layout, one shard in
memory at a time, with every other file of the release (config, tokenizer) copied. A run that updated
the routers' correction biases is not its adapter alone: --merge writes those biases in place of the
released ones, --peft refuses (a gap). Both are written into a temporary sibling folder renamed to DIR.
A release whose base weights are stored quantized (FP8, MXFP4: export/stored.py) merges into a bf16 release by
default (said on stdout, quantization_config removed); --requantize writes the stored format again and the
merge's error on a probe batch (export/probe.py), printed and written into DIR.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from onboard.errors import BadInput
from onboard.package.export.probe import REPORT, merge_error, write_report
from onboard.package.export.stored import (StoredWeight, bf16_layout, decode, encode, stored_weights,
                                           without_quantization_config)
from onboard.package.peft_format import ExportGap, adapter_file_state, hf_skeleton, key_pairs, peft_config
from onboard.package.reader import read_package
from runtime.lora.factors import delta_for
from runtime.model.weights import shard_order
from runtime.train.run_folder import read_adapter, read_biases, read_run

INDEX = "model.safetensors.index.json"


def _written_atomically(out: Path, write: Callable[[Path], None]) -> Path:
    out = Path(out)
    if out.exists():
        raise BadInput(out, None, "output folder already exists; choose another or remove it")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_peft(out: Path, state, config, family: str, weight_map: dict, release: Path) -> None:
    """The PEFT adapter folder of runtime LoRA `state`."""
    from peft import get_peft_model

    hf = hf_skeleton(release, family)
    cfg = peft_config(config, state, weight_map, hf, str(release))
    peft_model = get_peft_model(hf, cfg)
    state = adapter_file_state(peft_model, state, key_pairs(peft_model, weight_map), weight_map)
    cfg.save_pretrained(out)
    save_file(state, Path(out) / "adapter_model.safetensors", metadata={"format": "pt"})


def _release_view(delta: torch.Tensor, entry: dict) -> torch.Tensor:
    """The runtime-layout delta of one released tensor back in the release's layout."""
    if entry["rows"] is not None:
        delta = delta[entry["rows"][0]: entry["rows"][1]]
    return delta.transpose(-1, -2) if entry["transpose"] else delta


def _merged(name: str, value: torch.Tensor, weight_map: dict, state, scale: float, dtype, biases: dict) -> torch.Tensor:
    entry = weight_map.get(name) or {}
    if entry.get("target") in biases:
        return biases[entry["target"]].view(value.shape).to(dtype or value.dtype)
    # an own module's tensor has no target but the runtime tensor transformers loads it into;
    # with neither (vision, unread tensors) it is copied as released
    target = entry.get("target") or entry.get("own_module")
    delta = None if target is None else delta_for(state, scale, target, entry.get("expert"))
    dtype = dtype or value.dtype
    if delta is None:
        return value.to(dtype)
    return (value.float() + _release_view(delta, entry)).to(dtype)


def _merged_stored(weight: StoredWeight, codes: torch.Tensor, scale_t: torch.Tensor, state, scale: float,
                   dtype, requantize: bool) -> dict[str, torch.Tensor]:
    """A stored weight merged: decoded, the delta added in the codes' orientation, then written in bf16 under its
    logical name or re-encoded under the release's names (a weight no factor acts on stays as released). A stacked
    experts weight (gpt-oss's [E, O, ..]) goes one expert at a time: its fp32 copies are one expert's."""
    entry = weight.entry
    target = entry.get("target")
    if target and entry.get("expert") is None and scale_t.dim() == 3:
        parts = [_merged_one(weight, codes[e], scale_t[e], delta_for(state, scale, target, e), entry, dtype,
                             requantize) for e in range(codes.shape[0])]
        return {name: torch.stack([part[name] for part in parts]) for name in parts[0]}
    delta = delta_for(state, scale, target, entry.get("expert")) if target else None
    return _merged_one(weight, codes, scale_t, delta, entry, dtype, requantize)


def _merged_one(weight: StoredWeight, codes: torch.Tensor, scale_t: torch.Tensor, delta: torch.Tensor | None,
                entry: dict, dtype, requantize: bool) -> dict[str, torch.Tensor]:
    if requantize and delta is None:
        return {weight.stored.codes: codes, weight.stored.scale: scale_t}
    merged = decode(weight, codes, scale_t)
    if delta is not None:
        merged = merged + _release_view(delta, entry)
    if requantize:
        return encode(weight, merged, codes, scale_t)
    return {weight.logical: bf16_layout(weight, merged).to(dtype or torch.bfloat16)}


class _Shards(contextlib.ExitStack):
    """The release's shards, each opened once when first read (a scale may sit in another shard than its codes)."""

    def __init__(self, release: Path):
        super().__init__()
        self.release, self.open, self.where = release, {}, {}
        for file, names in shard_order(release).items():
            self.where |= dict.fromkeys(names, file)

    def opened(self, file: str):
        if file not in self.open:
            self.open[file] = self.enter_context(safe_open(self.release / file, "pt"))
        return self.open[file]

    def get(self, name: str) -> torch.Tensor:
        file = self.where.get(name)
        if file is None:
            raise BadInput(self.release, name, "the weight map's stored step names a tensor the release does not hold")
        return self.opened(file).get_tensor(name)


def write_merged(out: Path, release: Path, weight_map: dict, state, scale: float,
                 keep: Callable[[str], bool] = lambda name: True, dtype: torch.dtype | None = None,
                 biases: dict[str, torch.Tensor] | None = None, requantize: bool = False) -> None:
    """The release with LoRA merged: same names, shards and other files; only the tensors `keep` takes (by their
    logical names), in the release's dtypes (alignment asks for fp32 to see the merge apart from rounding);
    `biases` (runtime name -> correction bias) replace the released ones. Stored weights merge into bf16
    (quantization_config dropped), or with `requantize` into their stored format again."""
    out, release = Path(out), Path(release)
    stored = stored_weights(weight_map)
    scale_names = {w.stored.scale for w in stored.values()}
    kept: dict[str, str] = {}
    with _Shards(release) as shards:
        for file, names in shard_order(release).items():
            shard = shards.opened(file)
            tensors = {}
            for n in names:
                if n in scale_names or not keep(stored[n].logical if n in stored else n):
                    continue
                if n in stored:
                    tensors |= _merged_stored(stored[n], shard.get_tensor(n), shards.get(stored[n].stored.scale),
                                              state, scale, dtype, requantize)
                else:
                    tensors[n] = _merged(n, shard.get_tensor(n), weight_map, state, scale, dtype, biases or {})
            if tensors:
                save_file(tensors, out / file, metadata=shard.metadata())
                kept |= dict.fromkeys(tensors, file)
    for path in release.iterdir():
        if path.suffix != ".safetensors" and path.name != INDEX:
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, out / path.name)
    if stored and not requantize:
        without_quantization_config(out / "config.json")
    if (release / INDEX).exists():
        index = json.loads((release / INDEX).read_text())
        if stored and "total_size" in index.get("metadata", {}):
            index["metadata"] = {**index["metadata"], "total_size": _data_bytes(out, set(kept.values()))}
        (out / INDEX).write_text(json.dumps({**index, "weight_map": kept}, indent=2))


def _data_bytes(folder: Path, files: set[str]) -> int:
    total = 0
    for file in files:
        with (folder / file).open("rb") as f:
            total += (folder / file).stat().st_size - 8 - int.from_bytes(f.read(8), "little")
    return total


def export(run: Path, peft_dir: Path | None, merge_dir: Path | None, requantize: bool = False) -> tuple[Path, list[str]]:
    """Write the export; (its folder, lines that say what was written beyond the command's own line)."""
    info = read_run(run)
    release = Path(info.release)
    package = read_package(Path(info.package), release)
    spec, weight_map = package.spec, package.weight_map
    config, state = read_adapter(run)
    biases = read_biases(run)
    if peft_dir is not None:
        if biases:
            raise ExportGap(f"{run}: the run updated the routers' correction biases, which a PEFT adapter cannot "
                            "carry; use --merge to write them into the merged release")
        return _written_atomically(peft_dir, lambda tmp: write_peft(tmp, state, config, spec["family"], weight_map,
                                                                    release)), []
    stored = stored_weights(weight_map)
    formats = sorted({w.stored.format.kind for w in stored.values()})
    if requantize and not stored:
        raise BadInput(None, "--requantize", f"the release in {release} stores no quantized weights: there is no "
                                             "stored format to write again")
    notes: list[str] = []

    def write(tmp: Path) -> None:
        write_merged(tmp, release, weight_map, state, config.scale, biases=biases, requantize=requantize)
        if requantize:
            report = merge_error(spec, weight_map, release, tmp, config, state, biases)
            write_report(tmp, report)
            notes.append(f"re-quantized to the release's {'/'.join(formats)} weights (each block re-scaled); the "
                         f"merge's error on a probe batch ({report['probe']['batch']}x{report['probe']['tokens']} "
                         f"tokens, adapter path vs merged weights read back): logits relative RMS "
                         f"{report['logits_rel_rms']:.3g}, in {REPORT}")
        elif stored:
            notes.append(f"bf16: the release's {'/'.join(formats)} weights dequantized and merged, "
                         "quantization_config removed from config.json; --requantize writes the stored format again")

    return _written_atomically(merge_dir, write), notes
