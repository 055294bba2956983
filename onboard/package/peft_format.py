"""Our LoRA factors in PEFT's format, under the module names of the release's transformers class.

Dense projections (and the router): PEFT's LoRA on the transformers module the release tensor loads
into (after transformers' own checkpoint renamings), A [r, in], B [out, r]; through its 2D weight in
`target_parameters` where the module is no nn.Linear, or bears a name PEFT's MoE conversion would take
for an expert's. Routed experts: PEFT's `target_parameters` on the experts' 3D parameters (gate_up_proj,
down_proj): A [r*E, in] with rows e*r .. e*r+r-1 for expert e, B [out, r*E] with column j*E+e for
rank j of expert e (peft's ParamWrapper.get_delta_weight), so expert e's delta is scale * B_e @ A_e
in [out, in], whether transformers stores the parameter [E, out, in] or transposed [E, in, out].
Which state key holds which factor (the nesting of the two wrappers) is read off a PEFT model built
on the transformers class, never assumed.
Shape legend: E experts, r rank, O out width, I in width.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from onboard.release.transformers_classes import model_class
from runtime.lora.factors import LoraConfig
from runtime.lora.plan import module_map

LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")
EXPERT_PARAMS = {"gate_up_proj": "lora_gate_up", "down_proj": "lora_down"}


class ExportGap(Exception):
    """A valid adapter that PEFT's format (or this exporter) cannot express: exit 3."""


def hf_skeleton(source, family: str, config=None) -> nn.Module:
    """The release's transformers class on the meta device (names and shapes, no data)."""
    from transformers import AutoConfig

    config = config or AutoConfig.from_pretrained(source, trust_remote_code=False)
    with torch.device("meta"):
        return model_class(family)(config)


def _adapted(state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """(runtime modules with a dense pair lora_A/lora_B, runtime expert modules with stacked factors)."""
    dense = sorted({n.removesuffix(".lora_A") for n in state if n.endswith(".lora_A")})
    experts = sorted({n.removesuffix(".lora_gate_up_A") for n in state if n.endswith(".lora_gate_up_A")})
    return dense, experts


def hf_modules(hf: nn.Module, weight_map: dict) -> dict[str, str]:
    """Runtime module -> the transformers module it stands for, for every module stored whole as
    `<module>.weight`: the release's name after transformers' own checkpoint renamings (e.g. Kimi's
    `self_attn.f_a_proj` lives at `self_attn.forget_gate.f_a_proj`). Names a converter reshapes are left out."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(hf)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    out = {}
    for release, runtime in module_map(weight_map).items():
        key, converted = rename_source_key(release + ".weight", renamings, converters)
        if converted is None:
            out[runtime] = key.removesuffix(".weight")
    return out


def _expert_parameters(hf: nn.Module, runtime_module: str) -> list[str]:
    """transformers names of layer L's stacked expert parameters, for runtime `layers.L.ffn.experts`."""
    layer = runtime_module.split(".")[1]
    names = [n for n, p in hf.named_parameters() if p.dim() == 3 and n.rpartition(".")[2] in EXPERT_PARAMS
             and (m := LAYER_INDEX.search(n)) and m.group(1) == layer]
    if sorted(n.rpartition(".")[2] for n in names) != sorted(EXPERT_PARAMS):
        raise ExportGap(f"{type(hf).__name__} layer {layer}: no stacked gate_up_proj / down_proj expert parameters "
                        f"for PEFT's target_parameters (found {names})")
    return names


def _claimed_by_peft_conversion(hf: nn.Module) -> set[str]:
    """Module leaf names that PEFT's v4 -> v5 MoE conversion reads as the experts' pre-fusion names for this
    model type: it turns any target module so named (an attention gate_proj too) into the stacked expert
    parameter, so such modules are targeted through their weight parameter instead."""
    from peft.utils import transformers_weight_conversion as conversion

    base = conversion._MODEL_TO_CONVERSION_PATTERN.get(getattr(hf.config, "model_type", None))
    return set(conversion._MOE_TARGET_MODULE_MAPPING.get(base, {}))


def peft_config(config: LoraConfig, state: dict[str, torch.Tensor], weight_map: dict, hf: nn.Module, base: str):
    """peft.LoraConfig adapting the same modules of the transformers class as `state` does of ours."""
    import peft

    names = hf_modules(hf, weight_map)
    dense, experts = _adapted(state)
    present = dict(hf.named_modules())
    claimed = _claimed_by_peft_conversion(hf)
    modules, parameters = [], []
    for name in dense:
        module = names.get(name)
        if module not in present:
            raise ExportGap(f"runtime module {name}: no module {module!r} in {type(hf).__name__}")
        if isinstance(present[module], nn.Linear) and module.rpartition(".")[2] not in claimed:
            modules.append(module)
        else:
            parameters.append(module + ".weight")
    for name in experts:
        parameters += _expert_parameters(hf, name)
    if parameters and config.dropout:
        raise ExportGap(f"LoRA dropout {config.dropout} on {parameters[0]}: PEFT's target_parameters take no dropout")
    return peft.LoraConfig(r=config.rank, lora_alpha=config.alpha, use_rslora=config.use_rslora, target_modules=modules,
                           target_parameters=parameters or None, lora_dropout=config.dropout, bias="none",
                           base_model_name_or_path=base)


def _runtime_module(hf_path: str, parameter: str | None, hf_to_runtime: dict[str, str]) -> tuple[str, str]:
    """(runtime module, factor prefix) a PEFT LoRA layer stands for."""
    if parameter in EXPERT_PARAMS:
        return f"layers.{LAYER_INDEX.search('.' + hf_path + '.').group(1)}.ffn.experts", EXPERT_PARAMS[parameter]
    return hf_to_runtime[hf_path], "lora"


def key_pairs(peft_model: nn.Module, weight_map: dict) -> list[tuple[str, str, str]]:
    """(PEFT key prefix, runtime module, factor prefix) for every LoRA layer of a PEFT model."""
    from peft.tuners.lora import LoraLayer

    hf_to_runtime = {hf: runtime for runtime, hf in hf_modules(peft_model.get_base_model(), weight_map).items()}
    out = []
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        hf_path = name.removeprefix("base_model.model.").replace(".base_layer", "")
        parameter = getattr(module, "parameter_name", None)
        out.append((name, *_runtime_module(hf_path, parameter, hf_to_runtime)))
    return out


def to_peft(state: dict[str, torch.Tensor], pairs) -> dict[str, torch.Tensor]:
    """Runtime LoRA state -> PEFT adapter state (keys as adapter_model.safetensors holds them)."""
    out = {}
    for key, module, factor in pairs:
        A, B = state[f"{module}.{factor}_A"], state[f"{module}.{factor}_B"]
        if A.dim() == 3:
            E, r, _ = A.shape
            A, B = A.reshape(E * r, -1), B.permute(1, 2, 0).reshape(B.shape[1], r * E)
        out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = A.contiguous(), B.contiguous()
    return out


def adapter_file_state(peft_model: nn.Module, state: dict[str, torch.Tensor], pairs, weight_map: dict) -> dict[str, torch.Tensor]:
    """to_peft's state under the keys that land on PEFT's modules when PEFT loads it: PEFT applies
    transformers' checkpoint renamings to adapter keys, and one that is not idempotent on transformers' own
    names (`(^|model.)layers.` matching inside `language_model.layers.`) would move a key; such a factor is
    stored under the release's module name, which the renaming maps home."""
    out = to_peft(state, pairs)
    landed = _as_loaded(peft_model, out)
    if landed.keys() == out.keys():
        return out
    release = {runtime: name for name, runtime in module_map(weight_map).items()}
    stored = {}
    for key, value in out.items():
        module_key, _, leaf = key.rpartition(".lora_")
        runtime = next(m for k, m, _ in pairs if k == module_key)
        candidate = f"base_model.model.{release.get(runtime, '')}.lora_{leaf}"
        if key in landed:
            stored[key] = value
        elif runtime in release and key in _as_loaded(peft_model, {candidate: value}):
            stored[candidate] = value
        else:
            raise ExportGap(f"LoRA factor {key}: PEFT's loading conversion moves it off its module, under either name")
    return stored


def _as_loaded(peft_model: nn.Module, adapter_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers

    return convert_peft_adapter_state_dict_for_transformers(peft_model, peft_model.peft_config["default"], adapter_state)


def from_peft(peft_state: dict[str, torch.Tensor], pairs, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT adapter state -> runtime LoRA state shaped as `like` (the inverse of to_peft)."""
    out = {}
    for key, module, factor in pairs:
        A, B = peft_state[f"{key}.lora_A.weight"], peft_state[f"{key}.lora_B.weight"]
        A_like = like[f"{module}.{factor}_A"]
        if A_like.dim() == 3:
            E, r, _ = A_like.shape
            A, B = A.reshape(E, r, -1), B.reshape(B.shape[0], r, E).permute(2, 0, 1)
        out[f"{module}.{factor}_A"], out[f"{module}.{factor}_B"] = A.contiguous(), B.contiguous()
    return out
