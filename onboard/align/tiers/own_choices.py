"""Expert choices inside own modules, recorded and pinned for tier 2's bf16 check.

transformers' MoE blocks hand their routing to an experts module as `experts(hidden_states,
top_k_index, top_k_weights)`; that call is where the choice is visible whatever the router computes.
The fp32 run's (index, weights) are recorded there; in the bf16 run, a token whose expert set differs
from fp32's gets fp32's experts and weights (the bf16 router has no weights for experts it did not
choose), every other token keeps the bf16 router's own. Shape legend: N tokens, K experts per token.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

Choices = dict[str, tuple]  # module name -> (top_k_index_NK, top_k_weights_NK)


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules taking transformers' experts arguments, by name."""
    return {name: m for name, m in model.named_modules()
            if "top_k_index" in inspect.signature(m.forward).parameters}


ARGS = ("hidden_states", "top_k_index", "top_k_weights")


def _bound(args: tuple, kwargs: dict) -> dict:
    return {**dict(zip(ARGS, args)), **kwargs}


def record(model: nn.Module, into: Choices) -> list:
    """Hooks that store each experts call's (index, weights) in `into`; remove them when done."""
    def hook(name):
        def store(module, args, kwargs):
            bound = _bound(args, kwargs)
            into[name] = (bound["top_k_index"].detach(), bound["top_k_weights"].detach())
        return store
    return [m.register_forward_pre_hook(hook(n), with_kwargs=True) for n, m in experts_modules(model).items()]


def pin(model: nn.Module, truth: Choices) -> list:
    """Hooks that give each token whose expert set differs from `truth` truth's experts and weights;
    remove them when done."""
    def hook(name):
        def replace(module, args, kwargs):
            bound = _bound(args, kwargs)
            idx, weights = bound["top_k_index"], bound["top_k_weights"]
            idx_truth, weights_truth = truth[name]
            kept_N1 = (idx.sort(-1).values == idx_truth.sort(-1).values).all(-1, keepdim=True)
            bound.update(top_k_index=idx.where(kept_N1, idx_truth),
                         top_k_weights=weights.where(kept_N1, weights_truth.to(weights.dtype)))
            return (), bound
        return replace
    return [m.register_forward_pre_hook(hook(n), with_kwargs=True)
            for n, m in experts_modules(model).items() if n in truth]


def indices(choices: Choices) -> dict[str, torch.Tensor]:
    return {name: idx for name, (idx, _) in choices.items()}


def remove(hooks: list) -> None:
    for handle in hooks:
        handle.remove()
