"""What each kind of generated operator looks like: its signature, the fuzzed inputs it is validated on,
and how the model's own reference is called with them.

Shapes are drawn from a seed the LLM never sees (odd sizes included) and the values from a mix of
distributions, so a candidate cannot be fitted to the test inputs. Shape legend: B batch, T tokens,
D width, E experts, H heads, R rotary width.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class OpKind:
    name: str
    description: str
    signature: str  # the `def op(...)` line the candidate must define
    make_inputs: Callable[[torch.Generator], dict[str, torch.Tensor]]  # float inputs, fp64
    call_reference: Callable[[Callable, dict], torch.Tensor]  # the model's function on those inputs


def _size(gen: torch.Generator, low: int = 1, high: int = 67) -> int:
    return int(torch.randint(low, high + 1, (1,), generator=gen))


def mixed(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Normal values at a random scale, with a share of wide uniform ones and of near-zero ones."""
    scale = float(torch.empty(1).uniform_(0.3, 4.0, generator=gen))
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    pick = torch.rand(shape, generator=gen, dtype=torch.float64)
    wide = torch.empty(shape, dtype=torch.float64).uniform_(-6.0, 6.0, generator=gen)
    small = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.05
    return torch.where(pick < 0.25, wide, torch.where(pick < 0.4, small, x))


def _elementwise(gen: torch.Generator) -> dict[str, torch.Tensor]:
    rank = _size(gen, 1, 3)
    return {"x": mixed(gen, *[_size(gen) for _ in range(rank)])}


def _norm(gen: torch.Generator) -> dict[str, torch.Tensor]:
    width = _size(gen, 2, 97)
    return {"x_TD": mixed(gen, _size(gen), width), "weight_D": 1 + 0.1 * mixed(gen, width)}


def _decay(gen: torch.Generator) -> dict[str, torch.Tensor]:
    heads = _size(gen, 1, 9)
    return {"a_BTH": mixed(gen, _size(gen, 1, 3), _size(gen), heads), "A_log_H": mixed(gen, heads) * 0.3,
            "dt_bias_H": mixed(gen, heads) * 0.3}


def _residual(gen: torch.Generator) -> dict[str, torch.Tensor]:
    shape = (_size(gen, 1, 3), _size(gen), _size(gen, 2, 97))
    return {"skip_BTD": mixed(gen, *shape), "sublayer_BTD": mixed(gen, *shape)}


def _router(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"logits_TE": mixed(gen, _size(gen), _size(gen, 2, 67))}


def _rope(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"positions_T": torch.randint(0, 4096, (_size(gen),), generator=gen).double(),
            "inv_freq_R": 10000.0 ** (-torch.arange(0, 2 * _size(gen, 1, 32), 2, dtype=torch.float64) / 64)}


KINDS: dict[str, OpKind] = {k.name: k for k in [
    OpKind("activation", "an elementwise activation, as a config's hidden_act names it (the gate of a gated MLP)",
           "def op(x: torch.Tensor) -> torch.Tensor", _elementwise, lambda fn, i: fn(i["x"])),
    OpKind("router_scoring", "MoE router scores from router logits, per token over the experts",
           "def op(logits_TE: torch.Tensor) -> torch.Tensor", _router, lambda fn, i: fn(i["logits_TE"])),
    OpKind("norm", "a normalization over the last dimension with a learned per-channel weight",
           "def op(x_TD: torch.Tensor, weight_D: torch.Tensor) -> torch.Tensor", _norm,
           lambda fn, i: fn(i["x_TD"], i["weight_D"])),
    OpKind("rope", "rotary angles: positions times inverse frequencies, as (cos, sin) stacked on a last axis of 2",
           "def op(positions_T: torch.Tensor, inv_freq_R: torch.Tensor) -> torch.Tensor", _rope,
           lambda fn, i: fn(i["positions_T"], i["inv_freq_R"])),
    OpKind("linear_attention_decay", "the per-head log-decay (gate) of a linear attention layer, <= 0",
           "def op(a_BTH: torch.Tensor, A_log_H: torch.Tensor, dt_bias_H: torch.Tensor) -> torch.Tensor", _decay,
           lambda fn, i: fn(i["a_BTH"], i["A_log_H"], i["dt_bias_H"])),
    OpKind("residual_mixing", "how a block's output joins the residual stream",
           "def op(skip_BTD: torch.Tensor, sublayer_BTD: torch.Tensor) -> torch.Tensor", _residual,
           lambda fn, i: fn(i["skip_BTD"], i["sublayer_BTD"])),
]}
