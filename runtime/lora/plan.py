"""PKG/lora.yaml: the LoRA plan under the release's own module names, read into a runtime LoraConfig.

`targets` are fnmatch patterns over the release's (transformers) module names, such as
"model.layers.*.self_attn.q_proj": a module whose `.weight` the release stores. The package's
weight_map.json (released tensor -> runtime tensor) turns each into the runtime module it loads into.
`experts` and `router` need no names: they adapt every MoE layer's routed experts / router.
"""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn

from runtime import defaults
from runtime.errors import InputFileError
from runtime.lora.factors import LoraConfig
from runtime.spec import ModelSpec

LAYER_INDEX = re.compile(r"\.layers\.\d+\.")


class LoraFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rank: int = Field(defaults.LORA_RANK, gt=0)
    alpha: float = Field(defaults.LORA_ALPHA, gt=0, allow_inf_nan=False)
    dropout: float = Field(0.0, ge=0, lt=1, allow_inf_nan=False)
    use_rslora: bool = False
    targets: list[str] = []
    experts: bool = False
    router: bool = False
    seed: int = 0


def module_map(weight_map: dict[str, dict]) -> dict[str, str]:
    """Release module name -> runtime module name, for every module stored whole as `<module>.weight`."""
    out = {}
    for name, entry in weight_map.items():
        # an own module's tensor is loaded by transformers, by name, into the runtime tensor `own_module`;
        # entries with neither are tensors nothing reads
        target = entry["target"] or entry.get("own_module") or ""
        if name.endswith(".weight") and target.endswith(".weight") and entry["expert"] is None and entry["rows"] is None:
            out[name.removesuffix(".weight")] = target.removesuffix(".weight")
    return out


def runtime_targets(patterns: list[str], weight_map: dict[str, dict], path: Path) -> tuple[str, ...]:
    modules = module_map(weight_map)
    out = []
    for pattern in patterns:
        hits = [runtime for release, runtime in modules.items() if fnmatch.fnmatchcase(release, pattern)]
        if not hits:
            raise InputFileError(path, "targets", f"pattern {pattern!r} matches no module of the release's weight map")
        out += hits
    return tuple(dict.fromkeys(out))


def read_lora_yaml(path: Path, weight_map: dict[str, dict]) -> LoraConfig:
    path = Path(path)
    if not path.exists():
        raise InputFileError(path, None, "missing: the package has no LoRA plan (written by `onboard new-model`)")
    return lora_config(path.read_text(), path, weight_map)


def lora_config(text: str, path: Path, weight_map: dict[str, dict]) -> LoraConfig:
    """lora.yaml's text (read by the caller, who decides how a file may be opened) as a runtime LoraConfig."""
    try:
        data = LoraFile.model_validate(yaml.safe_load(text) or {})
    except (yaml.YAMLError, ValidationError) as err:
        first = err.errors()[0] if isinstance(err, ValidationError) else None
        key = ".".join(str(p) for p in first["loc"]) if first else None
        raise InputFileError(path, key, first["msg"] if first else f"not valid YAML ({err})") from None
    targets = runtime_targets(data.targets, weight_map, path)
    return LoraConfig(rank=data.rank, alpha=data.alpha, dropout=data.dropout, use_rslora=data.use_rslora,
                      targets=targets, experts=data.experts, router=data.router, seed=data.seed)


def default_lora_file(spec: ModelSpec, weight_map: dict[str, dict]) -> LoraFile:
    """Rank and alpha of runtime/defaults.py, every attention and linear-attention projection; experts and
    router off. The DSA indexer is left out: it only selects keys, so the loss sends no gradient into it."""
    from runtime.model.decoder import HybridDecoder

    with torch.device("meta"):
        model = HybridDecoder(spec)
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)
               and fnmatch.fnmatchcase(name, "layers.*.attn.*") and ".indexer." not in name}
    modules = module_map(weight_map)
    chosen = sorted({r for r, runtime in modules.items() if runtime in linears} | _own_attention_linears(spec))
    return LoraFile(targets=_by_layer_pattern(chosen, list(modules)))


def _own_attention_linears(spec: ModelSpec) -> set[str]:
    """Released modules of own modules that transformers builds as nn.Linear inside its attention modules:
    the token mixer's projections (recognition lists them per part; in an own layer the part a tensor is
    filed under is bookkeeping, so both parts are read)."""
    return {name for layer in spec.layers for part in (layer.attention, layer.ffn) if part.kind == "own_module"
            for name in part.linears}


def _by_layer_pattern(chosen: list[str], modules: list[str]) -> list[str]:
    """Layer indices folded into `*`, when those patterns name exactly the chosen modules."""
    patterns = sorted({LAYER_INDEX.sub(".layers.*.", m) for m in chosen})
    named = {m for m in modules if any(fnmatch.fnmatchcase(m, p) for p in patterns)}
    return patterns if named == set(chosen) else chosen


def lora_yaml_text(lora: LoraFile) -> str:
    header = ("# LoRA plan. targets: fnmatch patterns over the release's module names (the module whose .weight\n"
              "# the release stores); experts: routed experts of every MoE layer; router: off keeps the balance.\n")
    return header + yaml.safe_dump(lora.model_dump(), sort_keys=False)
