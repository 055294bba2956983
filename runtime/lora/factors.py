"""LoRA on the runtime model: which modules get factors, how they start, merge, save and load.

Dense projections (attention, linear attention, dense MLPs, shared experts) matching the config's
module-name patterns, whether nn.Linear or StoredLinear (a stored base, runtime/formats/linear.py), become LoraLinear (runtime/model/layers/lora_linear.py). Routed experts get stacked
factors that the MoE op's grouped GEMMs take (lora_gate_up / lora_down): no per-expert loop. The
router, off by default since it moves the learned load balance, gets a low-rank delta on its weight.
Every base parameter is frozen; the factors are fp32 whatever the base dtype.

Initialization is PEFT's default: A kaiming-uniform (a = sqrt(5), fan-in the projection's input
width, per expert for stacked factors), B zeros, so the adapted model starts equal to the base.
Each A is drawn from its own CPU generator seeded by (config.seed, module name), so the draw does not
depend on the global RNG, the module order or which other modules are targeted.
Shape legend: E experts, r rank, D model width, F expert width, O / I a weight's out / in width.
"""
from __future__ import annotations

import fnmatch
import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from runtime.formats.linear import StoredLinear
from runtime.formats.weight import StoredWeight
from runtime.model.layers.ffn import Experts, Router
from runtime.model.layers.lora_linear import LoraLinear

@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    dropout: float = 0.0
    # scale alpha / sqrt(rank) (rsLoRA) instead of alpha / rank
    use_rslora: bool = False
    # runtime module-name patterns (fnmatch), e.g. "layers.*.attn.q_proj"; every nn.Linear matching one gets LoRA
    targets: tuple[str, ...] = ()
    # routed experts (stacked factors on w_gate_up and w_down of every MoE layer)
    experts: bool = False
    # the MoE router's weight; off by default: it disturbs the learned expert balance
    router: bool = False
    # with the module name, seeds each factor's initialization (see the module docstring)
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def is_lora_name(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("lora_")


def apply_lora(model: nn.Module, config: LoraConfig) -> list[str]:
    """Freeze `model` and add LoRA factors where `config` says; returns the adapted module names."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = _wrap_linears(model, config)
    for name, module in list(model.named_modules()):
        if (config.experts and isinstance(module, Experts)) or (config.router and isinstance(module, Router)):
            _add_stacked(module, name, config)
            adapted.append(name)
    if not adapted:
        raise ValueError(f"LoRA config matches no module of the model: targets {list(config.targets)}, "
                         f"experts={config.experts}, router={config.router}")
    return adapted


def _wrap_linears(model: nn.Module, config: LoraConfig) -> list[str]:
    names = [name for name, m in model.named_modules()
             if type(m) in (nn.Linear, StoredLinear) and any(fnmatch.fnmatchcase(name, p) for p in config.targets)]
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        wrapped = LoraLinear(getattr(parent, leaf), config.rank, config.scale, config.dropout)
        _kaiming(wrapped.lora_A, config, name)
        setattr(parent, leaf, wrapped)
    return names


def _factor(shape: tuple[int, ...], like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=torch.float32, device=like.device))


def _add_stacked(module: nn.Module, name: str, config: LoraConfig) -> None:
    r = config.rank
    if isinstance(module, Router):
        E, D = module.weight.shape
        module.lora_A, module.lora_B = _factor((r, D), module.weight), _factor((E, r), module.weight)
        _kaiming(module.lora_A, config, name)
    else:
        (E, two_f, D), width = module.w_gate_up.shape, module.w_down.shape[2]
        module.lora_gate_up_A = _factor((E, r, D), module.w_gate_up)
        module.lora_gate_up_B = _factor((E, two_f, r), module.w_gate_up)
        module.lora_down_A, module.lora_down_B = _factor((E, r, width), module.w_down), _factor((E, D, r), module.w_down)
        _kaiming(module.lora_gate_up_A, config, name + ".gate_up")
        _kaiming(module.lora_down_A, config, name + ".down")
    module.lora_scale = config.scale


def _kaiming(A: nn.Parameter, config: LoraConfig, name: str) -> None:
    with torch.no_grad():
        A.copy_(_kaiming_value(tuple(A.shape), config, name))


def _kaiming_value(shape: tuple[int, ...], config: LoraConfig, name: str) -> torch.Tensor:
    """PEFT's A init, fan-in the last dim (stacked factors: per expert), from a (seed, name) generator."""
    generator = torch.Generator().manual_seed((config.seed << 32) + zlib.crc32(name.encode()))
    value = torch.empty(shape, dtype=torch.float32).view(-1, shape[-1])
    nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
    return value.view(shape)


# factor leaf -> suffix of the name its generator is seeded by (as _wrap_linears and _add_stacked seed them)
_SEED_SUFFIX = {"lora_A": "", "lora_gate_up_A": ".gate_up", "lora_down_A": ".down"}


def initial_value(name: str, shape: tuple[int, ...], config: LoraConfig) -> torch.Tensor:
    """The full fp32 starting value of LoRA factor `name` (what apply_lora writes): for a model built
    elsewhere (the meta device, then sharded) that initializes its own slices."""
    module, _, leaf = name.rpartition(".")
    if leaf not in _SEED_SUFFIX:
        return torch.zeros(shape, dtype=torch.float32)
    return _kaiming_value(shape, config, module + _SEED_SUFFIX[leaf])


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if is_lora_name(name)]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Runtime name -> LoRA factor (detached, fp32)."""
    return {name: p.detach() for name, p in model.named_parameters() if is_lora_name(name)}


def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy every factor of `state` into the (already adapted) model; names and shapes must match exactly."""
    own = dict(model.named_parameters())
    expected = {n for n in own if is_lora_name(n)}
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise KeyError(f"LoRA state dict does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, value in state.items():
            if value.shape != own[name].shape:
                raise ValueError(f"LoRA factor {name}: shape {tuple(value.shape)}, model has {tuple(own[name].shape)}")
            own[name].copy_(value)


def delta_for(state: dict[str, torch.Tensor], scale: float, name: str, expert: int | None = None) -> torch.Tensor | None:
    """The fp32 LoRA delta of runtime tensor `name` (a base weight) under the factors of `state`, in
    that tensor's layout (of one expert's slice when `expert` is given); None when no factor acts on it."""
    module, _, leaf = name.rpartition(".")
    if leaf == "weight" and f"{module}.lora_A" in state:
        return scale * (state[f"{module}.lora_B"] @ state[f"{module}.lora_A"])
    stacked = {"w_gate_up": "lora_gate_up", "w_down": "lora_down"}.get(leaf)
    if not stacked or f"{module}.{stacked}_A" not in state:
        return None
    A_ErI, B_EOr = state[f"{module}.{stacked}_A"], state[f"{module}.{stacked}_B"]
    if expert is not None:
        return scale * (B_EOr[expert] @ A_ErI[expert])
    return scale * torch.bmm(B_EOr, A_ErI)


def _set_merged(model: nn.Module, merged: bool) -> None:
    state = lora_state_dict(model)
    with torch.no_grad():
        for module_name, module in model.named_modules():
            pairs = [(p, delta_for(state, module.lora_scale, f"{module_name}.{leaf}"))
                     for leaf, p in module.named_parameters(recurse=False)] if hasattr(module, "lora_scale") else []
            pairs = [(p, delta) for p, delta in pairs if delta is not None]
            if not pairs:
                if any(isinstance(m, StoredWeight) for m in module.children()):
                    raise ValueError(f"LoRA cannot be merged into {module_name}: its base weight is stored quantized "
                                     "(a merged export re-encodes it: export --merge --requantize)")
                continue
            if module.lora_merged == merged:
                raise ValueError(f"LoRA is already {'merged' if merged else 'unmerged'} in {module_name}")
            for weight, delta in pairs:
                # in fp32, rounded once to the base dtype: unmerge restores an fp32 base to fp32 rounding
                weight.copy_((weight.float() + (delta if merged else -delta)).to(weight.dtype))
            module.lora_merged = merged


def merge_lora(model: nn.Module) -> None:
    """Fold every LoRA delta into its base weight; the factors stay (and stop acting) until unmerge."""
    _set_merged(model, True)


def unmerge_lora(model: nn.Module) -> None:
    _set_merged(model, False)
