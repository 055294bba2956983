"""Fused Triton kernels for the gated delta rule (GDN, scalar decay) and KDA (per-channel decay).

Same signatures and return values as reference_ops/gated_delta.py and reference_ops/kda.py:
o in q's dtype, final state in fp32. Inputs bf16 or fp32; accumulation and state in fp32.
`variant` (keyword only, a KernelVariant or a name in VARIANTS) selects launch settings under
measurement; None (or "default") is function.default_variant: the fastest measured settings for the decay
kind, with fp32 intermediates for fp32 inputs.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from runtime.kernels.gated_delta.function import (
    FP32_TILES, PER_CHANNEL_DECAY_DEFAULT, KernelVariant, chunk_delta_rule,
)

# Named settings the benchmark times side by side. "base" (KernelVariant()) is the path the others change one
# choice of; "forward_before" is the forward measured at GDN 1.68 ms (prep_kernel with diag_kernel's
# row-substitution inverse, tf32 products, bf16 u, output in value blocks of 64, 8-warp scan).
VARIANTS: dict[str, KernelVariant] = {
    "base": KernelVariant(),
    # the gradient kernels' remaining tf32 products on bf16 operands (GDN and KDA)
    "bf16_grads": KernelVariant(bf16_grad_dots=True),
    # KDA only (GDN runs the default's kernels): the exact per-channel diagonal blocks token-parallel
    "token_diag": KernelVariant(token_parallel_diag=True),
    "token_diag_unblocked": KernelVariant(token_parallel_diag=True, blocked_prep=False),
    "token_diag_h8": KernelVariant(token_parallel_diag=True, token_diag_heads=8),
    # KDA only: the per-channel Gram backward of dL and dP in backward.gram_grad_kernel (gram_grad_apart) with
    # wy_grad's products on bf16 operands and state_grad in key blocks of 32, on the one-launch prep_kernel: the
    # per-channel default from 13:50 to 14:20 (5.56 ms; tf32 wy_grad 6.53, gram_grad at 8 warps 6.51 at 13:40)
    "kda_gram_apart_bf16_skb32": KernelVariant(token_parallel_diag=True, blocked_prep=False, gram_grad_apart=True,
                                               bf16_grad_dots=True, state_grad_key_block=32),
    # the same with prep in two launches, 32 columns per column program (5.35 ms at 14:20; the default takes 64)
    "kda_split_prep_ga": KernelVariant(token_parallel_diag=True, split_prep=True, gram_grad_apart=True,
                                       bf16_grad_dots=True, state_grad_key_block=32),
    # GDN's default with state_grad in key blocks of 32 (2.82 against 2.79 ms at 14:20), or with prep in two
    # launches as KDA's default (2.89)
    "gdn_bf16_skb32": KernelVariant(bf16_grad_dots=True, state_grad_key_block=32),
    "gdn_split_prep_c64": KernelVariant(bf16_grad_dots=True, split_prep=True, prep_column_block=64),
    # each decay kind's default before 16:24, without stored norms, the fused finish (GDN) and o in the scan
    # (16:22: GDN 2.79 ms against the three with state_grad key block 32 2.72, KDA 5.27 against 5.12; each flag
    # alone in bench/bench_gated_delta.py's docstring). GDN's is "bf16_grads" above
    "kda_before_1624": replace(PER_CHANNEL_DECAY_DEFAULT, stored_norms=False, scan_output=False),
    "fp32_tiles": FP32_TILES,
    "recompute": KernelVariant(keep_forward=False),
    "in_chunk_diagonal": KernelVariant(split_diagonal=False),
    "forward_before": KernelVariant(blocked_prep=False, doubling_inverse=False, bf16_dots=False, fp32_u=False,
                                    output_value_block=64, forward_scan_warps=8),
    # the default's prep ran 8 warps until 11:28 (GDN prep 0.63 ms against 0.42 with 4)
    "prep_w8": KernelVariant(prep_warps=8),
    "unblocked_prep": KernelVariant(blocked_prep=False),
    "scan_w8": KernelVariant(forward_scan_warps=8),
    "scan_bv16": KernelVariant(scan_value_block=16),
    "output_bv64": KernelVariant(output_value_block=64),
    "tf32_dots": KernelVariant(bf16_dots=False),
    "bf16_u": KernelVariant(fp32_u=False),
}


def _resolve(variant: KernelVariant | str | None) -> KernelVariant | None:
    """None for "default" (chunk_delta_rule then picks function.default_variant)."""
    if variant == "default":
        return None
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
