"""Fused Triton kernels for the gated delta rule (GDN, scalar decay) and KDA (per-channel decay).

Same signatures and return values as reference_ops/gated_delta.py and reference_ops/kda.py:
o in q's dtype, final state in fp32. Inputs bf16 or fp32; accumulation and state in fp32.
`variant` (keyword only, a KernelVariant or a name in VARIANTS) selects launch settings under
measurement; None is the validated default path.
"""
from __future__ import annotations

import torch

from runtime.kernels.gated_delta.function import KernelVariant, chunk_delta_rule

_BF16_SCAN = dict(bf16_tiles=True, bf16_states=True, scan_value_block=32, scan_stages=2, scan_warps=8)
VARIANTS: dict[str, KernelVariant] = {
    "default": KernelVariant(),
    "bf16_tiles": KernelVariant(bf16_tiles=True),
    "bf16_tiles_states": KernelVariant(bf16_tiles=True, bf16_states=True),
    "scan_w8": KernelVariant(scan_warps=8),
    "bf16_scan": KernelVariant(**_BF16_SCAN),
    "split_diagonal": KernelVariant(split_diagonal=True),
    "keep_forward": KernelVariant(keep_forward=True),
    "all_but_keep": KernelVariant(**_BF16_SCAN, split_diagonal=True),
    "all": KernelVariant(**_BF16_SCAN, split_diagonal=True, keep_forward=True),
}


def _resolve(variant: KernelVariant | str | None) -> KernelVariant | None:
    return VARIANTS[variant] if isinstance(variant, str) else variant


def gated_delta_rule(
    q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, scale=None, initial_state_BHKV=None, use_qk_l2norm=True, cu_seqlens=None,
    *, variant: KernelVariant | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_BTHV, final_state_BHKV); g_BTH log decay per head and token."""
    return chunk_delta_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, scale, initial_state_BHKV, use_qk_l2norm,
                            cu_seqlens, _resolve(variant))


def kda(
    q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale=None, initial_state_BHKV=None, use_qk_l2norm=True, cu_seqlens=None,
    *, variant: KernelVariant | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_BTHV, final_state_BHKV); g_BTHK log decay per head, token and key channel."""
    return chunk_delta_rule(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale, initial_state_BHKV, use_qk_l2norm,
                            cu_seqlens, _resolve(variant))
