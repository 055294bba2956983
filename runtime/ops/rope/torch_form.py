"""Rotary position embedding in the runtime: tables in fp32 as transformers builds them, rotation in fp32.

Shape legend: B batch, T tokens, H heads, K head dim, R rotary dim (R <= K, even), F = R/2 frequencies.
cos/sin hold each frequency twice: [f_0..f_{F-1}, f_0..f_{F-1}]; they are returned in fp32.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

# Rope types a package generated, by the spec's rope_type: op(positions_T, inv_freq_F) -> [T, F, 2] (cos, sin),
# the op scaling the unscaled frequencies itself (runtime/package_ops.py adds them when the package loads)
ROPES: dict[str, Callable] = {}


def rope_type_of(scaling: dict | None) -> str:
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """inv_freq[F] (fp32) and the attention factor that scales cos/sin (1.0 except yarn).

    scaling is transformers' rope_parameters / rope_scaling dict; rope_type default, linear, llama3,
    yarn, or dynamic (equal to default at the training length).
    """
    scaling = scaling or {}
    rope_type = rope_type_of(scaling)
    # fp32 arithmetic on purpose: the released models' tables were built this way by transformers
    exponents_F = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq_F = 1.0 / (theta**exponents_F)
    if rope_type in ("default", "dynamic"):
        return inv_freq_F, 1.0
    if rope_type == "linear":
        return inv_freq_F / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq_F, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq_F, rotary_dim, theta, scaling)
    raise ValueError(f"rope scaling: rope_type {rope_type!r} is not one of default, linear, llama3, yarn, dynamic")


def _llama3(inv_freq_F: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen_F = 2 * math.pi / inv_freq_F
    smooth_F = (old_len / wavelen_F - low) / (high - low)
    blended_F = (1 - smooth_F) * inv_freq_F / factor + smooth_F * inv_freq_F
    long_F = torch.where(wavelen_F > old_len / low, inv_freq_F / factor, blended_F)
    return torch.where(wavelen_F < old_len / high, inv_freq_F, long_F)


def _yarn(inv_freq_F: torch.Tensor, rotary_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    if scaling.get("factor") is None:
        raise ValueError("rope scaling: yarn needs key 'factor' (derive it from max_position_embeddings first)")
    factor, original_len = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_turning(num_rotations: float) -> float:
        return rotary_dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(scaling.get("beta_fast") or 32), dim_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    # equal bounds would divide by zero; transformers widens them the same way
    high = high + 0.001 if low == high else high
    interpolate_F = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq_F = inv_freq_F / factor * interpolate_F + inv_freq_F * (1 - interpolate_F)
    return inv_freq_F, _yarn_attention_factor(scaling)


def _yarn_attention_factor(scaling: dict) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_cos_sin(
    positions_BT: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_BTR, sin_BTR in fp32 for integer positions_BT."""
    angles_BTF = positions_BT.float()[..., None] * inv_freq.float()
    angles_BTR = torch.cat([angles_BTF, angles_BTF], dim=-1)
    return angles_BTR.cos() * attention_factor, angles_BTR.sin() * attention_factor


def generated_cos_sin(op: Callable, positions_BT: torch.Tensor, inv_freq_F: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_BTR, sin_BTR in fp32 from a generated rope op's (cos, sin) table of the unscaled frequencies."""
    B, T = positions_BT.shape
    table_NF2 = op(positions_BT.reshape(-1).float(), inv_freq_F.float()).float()
    cos_BTF, sin_BTF = (table_NF2[..., i].reshape(B, T, -1) for i in (0, 1))
    return torch.cat([cos_BTF, cos_BTF], dim=-1), torch.cat([sin_BTF, sin_BTF], dim=-1)


def mrope_cos_sin(
    positions_3BT: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: list[int],
    interleaved: bool,
    attention_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rope (Qwen2-VL contiguous sections, Qwen3-VL/Qwen3.5 interleaved): cos_BTR, sin_BTR in fp32."""
    axis_F = mrope_axes(inv_freq.shape[0], mrope_section, interleaved).to(positions_3BT.device)
    angles_3BTF = positions_3BT.float()[..., None] * inv_freq.float()
    # pick, for every frequency, the angle of the position axis that drives it
    index_1BTF = axis_F.expand(1, *angles_3BTF.shape[1:])
    angles_BTF = angles_3BTF.gather(0, index_1BTF)[0]
    angles_BTR = torch.cat([angles_BTF, angles_BTF], dim=-1)
    return angles_BTR.cos() * attention_factor, angles_BTR.sin() * attention_factor


def mrope_axes(num_freqs: int, mrope_section: list[int], interleaved: bool) -> torch.Tensor:
    """axis_F: 0 time, 1 height, 2 width for each frequency."""
    if sum(mrope_section) != num_freqs:
        raise ValueError(f"mrope_section {mrope_section} must sum to rotary_dim/2 = {num_freqs}")
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
    j_F = torch.arange(num_freqs)
    axis_F = torch.zeros(num_freqs, dtype=torch.int64)
    axis_F[(j_F % 3 == 1) & (j_F < 3 * mrope_section[1])] = 1
    axis_F[(j_F % 3 == 2) & (j_F < 3 * mrope_section[2])] = 2
    return axis_F


def apply_rope(
    x_BTHK: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first R channels of each head (pairs (i, i+R/2), or (2i, 2i+1) when interleaved); rest passes."""
    rotary_dim = cos_BTR.shape[-1]
    x_rot = x_BTHK[..., :rotary_dim].float()
    cos_BT1R, sin_BT1R = cos_BTR.float().unsqueeze(2), sin_BTR.float().unsqueeze(2)
    if interleaved:
        cos_BT1R = cos_BT1R[..., : rotary_dim // 2].repeat_interleave(2, dim=-1)
        sin_BT1R = sin_BT1R[..., : rotary_dim // 2].repeat_interleave(2, dim=-1)
    rotated = x_rot * cos_BT1R + _rotate_pairs(x_rot, interleaved) * sin_BT1R
    return torch.cat([rotated.to(x_BTHK.dtype), x_BTHK[..., rotary_dim:]], dim=-1)


def _rotate_pairs(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """(a, b) -> (-b, a) for every rotated pair."""
    if interleaved:
        return torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)
