"""Reference rotary position embedding in fp64, following transformers' rope conventions.

Shape legend: B batch, T tokens, H heads, K head dim, R rotary dim (R <= K, even), F = R/2 frequencies.
cos/sin hold each frequency twice, as transformers does: [f_0..f_{F-1}, f_0..f_{F-1}].
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """inv_freq[F] and the attention factor that scales cos/sin (1.0 except yarn).

    scaling is transformers' rope_parameters / rope_scaling dict; rope_type default, linear, llama3,
    yarn, or dynamic (equal to default at the training length).
    """
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    inv_freq = [theta ** (-2 * i / rotary_dim) for i in range(rotary_dim // 2)]
    if rope_type in ("default", "dynamic"):
        return torch.tensor(inv_freq, dtype=torch.float64), 1.0
    if rope_type == "linear":
        return torch.tensor([f / scaling["factor"] for f in inv_freq], dtype=torch.float64), 1.0
    if rope_type == "llama3":
        return torch.tensor([_llama3_freq(f, scaling) for f in inv_freq], dtype=torch.float64), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, rotary_dim, theta, scaling)
    raise ValueError(f"rope scaling: rope_type {rope_type!r} is not one of default, linear, llama3, yarn, dynamic")


def _llama3_freq(inv_freq: float, scaling: dict) -> float:
    """Llama 3.1: long wavelengths are divided by factor, short ones kept, the band between blended."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    if wavelen < old_len / high:
        return inv_freq
    if wavelen > old_len / low:
        return inv_freq / factor
    smooth = (old_len / wavelen - low) / (high - low)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def _yarn(inv_freq: list[float], rotary_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies below a ramp are interpolated (divided by factor), above it kept."""
    if scaling.get("factor") is None:
        raise ValueError("rope scaling: yarn needs key 'factor' (derive it from max_position_embeddings first)")
    factor = scaling["factor"]
    low, high = _yarn_ramp_bounds(rotary_dim, theta, scaling)
    freqs = []
    for i, f in enumerate(inv_freq):
        interpolate = min(max((i - low) / (high - low), 0.0), 1.0)
        freqs.append(f / factor * interpolate + f * (1 - interpolate))
    return torch.tensor(freqs, dtype=torch.float64), _yarn_attention_factor(scaling)


def _yarn_ramp_bounds(rotary_dim: int, theta: float, scaling: dict) -> tuple[float, float]:
    """Frequency indices where the ramp starts and ends: dims that turn beta_fast / beta_slow times."""
    original_len = scaling["original_max_position_embeddings"]

    def dim_turning(num_rotations: float) -> float:
        return rotary_dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(scaling.get("beta_fast") or 32), dim_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    # equal bounds would divide by zero; transformers widens them the same way
    return low, high + 0.001 if low == high else high


def _yarn_attention_factor(scaling: dict) -> float:
    """cos/sin multiplier: explicit attention_factor, else mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
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
    """cos_BTR, sin_BTR for integer positions_BT, each frequency repeated in both halves."""
    angles_BTF = positions_BT.double()[..., None] * inv_freq.double()
    angles_BTR = torch.cat([angles_BTF, angles_BTF], dim=-1)
    return angles_BTR.cos() * attention_factor, angles_BTR.sin() * attention_factor


def mrope_axis_of_frequency(num_freqs: int, mrope_section: list[int], interleaved: bool) -> list[int]:
    """For each frequency, which position axis drives it: 0 time, 1 height, 2 width.

    Contiguous (Qwen2-VL): sections [t, h, w] in order. Interleaved (Qwen3-VL, Qwen3.5): frequency j
    is height when j % 3 == 1 and j < 3 * h, width when j % 3 == 2 and j < 3 * w, else time.
    """
    if sum(mrope_section) != num_freqs:
        raise ValueError(f"mrope_section {mrope_section} must sum to rotary_dim/2 = {num_freqs}")
    if not interleaved:
        return [axis for axis, size in enumerate(mrope_section) for _ in range(size)]
    axes = []
    for j in range(num_freqs):
        is_h = j % 3 == 1 and j < 3 * mrope_section[1]
        is_w = j % 3 == 2 and j < 3 * mrope_section[2]
        axes.append(1 if is_h else 2 if is_w else 0)
    return axes


def mrope_cos_sin(
    positions_3BT: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: list[int],
    interleaved: bool,
    attention_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rope: cos_BTR, sin_BTR where each frequency takes its angle from one of the t/h/w positions."""
    axes = mrope_axis_of_frequency(inv_freq.shape[0], mrope_section, interleaved)
    angles_BTF = torch.stack(
        [positions_3BT[axis].double() * inv_freq[j].double() for j, axis in enumerate(axes)], dim=-1
    )
    angles_BTR = torch.cat([angles_BTF, angles_BTF], dim=-1)
    return angles_BTR.cos() * attention_factor, angles_BTR.sin() * attention_factor


def apply_rope(
    x_BTHK: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first R channels of every head; channels R..K pass through (partial rotary).

    Pairs (i, i + R/2) when interleaved is False (Llama/Qwen layout), (2i, 2i + 1) when True
    (DeepSeek/GLM layout, rotated in place). Pair i turns by the angle of frequency i.
    """
    x = x_BTHK.double()
    rotary_dim = cos_BTR.shape[-1]
    cos_BT1F = cos_BTR[..., : rotary_dim // 2].double().unsqueeze(2)
    sin_BT1F = sin_BTR[..., : rotary_dim // 2].double().unsqueeze(2)
    if interleaved:
        first, second = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    else:
        first, second = x[..., : rotary_dim // 2], x[..., rotary_dim // 2 : rotary_dim]
    new_first = first * cos_BT1F - second * sin_BT1F
    new_second = second * cos_BT1F + first * sin_BT1F
    if interleaved:
        rotated = torch.stack([new_first, new_second], dim=-1).flatten(-2)
    else:
        rotated = torch.cat([new_first, new_second], dim=-1)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
