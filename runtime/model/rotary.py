"""Rotary tables for a layer's RopeSpec, built once per forward and shared by the layers with the same one."""
from __future__ import annotations

import torch

from runtime.spec import RopeSpec
from runtime.ops.rope.torch_form import ROPES, generated_cos_sin, mrope_cos_sin, rope_cos_sin, rope_inv_freq, rope_type_of


def rope_key(rope: RopeSpec) -> tuple:
    """What the tables depend on (`interleaved` only changes how they are applied); the scaling dict and the
    section list are not hashable, so they enter by their repr and as a tuple."""
    return rope.theta, rope.rotary_dim, repr(rope.scaling), tuple(rope.mrope_section or ()), rope.mrope_interleaved


def cos_sin(rope: RopeSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [B, T] or, for multimodal rope, [3, B, T]. Returns fp32 cos/sin [B, T, R]."""
    generated = ROPES.get(rope_type_of(rope.scaling))
    if generated is not None:
        if rope.mrope_section:
            raise ValueError(f"rope_type {rope_type_of(rope.scaling)!r} is generated: not for multimodal rope")
        inv_freq, _ = _inv_freq_on(rope, positions.device, scaled=False)
        return generated_cos_sin(generated, positions, inv_freq)
    inv_freq, attention_factor = _inv_freq_on(rope, positions.device, scaled=True)
    if rope.mrope_section:
        positions_3BT = positions if positions.dim() == 3 else positions.unsqueeze(0).expand(3, -1, -1)
        return mrope_cos_sin(positions_3BT, inv_freq, list(rope.mrope_section), rope.mrope_interleaved,
                             attention_factor)
    positions_BT = positions[0] if positions.dim() == 3 else positions
    return rope_cos_sin(positions_BT, inv_freq, attention_factor)


# inv_freq is computed on the host; copied to the device once per rope and device, since a host-to-device
# copy in every forward is a sync that a captured step (runtime/train/step_graph.py) cannot hold
_INV_FREQ_ON_DEVICE: dict[tuple, tuple[torch.Tensor, float]] = {}


def _inv_freq_on(rope: RopeSpec, device: torch.device, scaled: bool) -> tuple[torch.Tensor, float]:
    key = (rope_key(rope), scaled, device)
    if key not in _INV_FREQ_ON_DEVICE:
        inv_freq, factor = rope_inv_freq(rope.rotary_dim, rope.theta, rope.scaling if scaled else None)
        _INV_FREQ_ON_DEVICE[key] = inv_freq.to(device), factor
    return _INV_FREQ_ON_DEVICE[key]


class RotaryCache:
    """Tables keyed by rope config for one forward pass."""

    def __init__(self, positions: torch.Tensor):
        self.positions = positions
        self.tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, rope: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
        key = rope_key(rope)
        if key not in self.tables:
            self.tables[key] = cos_sin(rope, self.positions)
        return self.tables[key]
