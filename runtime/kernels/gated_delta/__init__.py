"""Fused Triton kernels for the gated delta rule (GDN, scalar decay) and KDA (per-channel decay).

Same signatures and return values as reference_ops/gated_delta.py and reference_ops/kda.py:
o in q's dtype, final state in fp32. Inputs bf16 or fp32; accumulation and state in fp32.
`variant` (keyword only, a KernelVariant or a name in VARIANTS) selects launch settings under
measurement; None (or "default") is function.default_variant: the fastest measured settings for the decay
kind, with fp32 intermediates for fp32 inputs.
"""
from __future__ import annotations

import torch

from runtime.kernels.gated_delta.function import FP32_TILES, KernelVariant, chunk_delta_rule

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
    # KDA only: the per-channel Gram backward of dL and dP in backward.gram_grad_kernel (gram_grad_apart), on the
    # KDA default ("kda_gram_apart"), with wy_grad's products on bf16 operands too ("kda_gram_apart_bf16"), that
    # with gram_grad_kernel at 8 warps ("..._w8") or state_grad_kernel in key blocks of 32 ("..._skb32")
    "kda_gram_apart": KernelVariant(token_parallel_diag=True, blocked_prep=False, gram_grad_apart=True),
    "kda_gram_apart_bf16": KernelVariant(token_parallel_diag=True, blocked_prep=False, gram_grad_apart=True,
                                         bf16_grad_dots=True),
    "kda_gram_apart_bf16_w8": KernelVariant(token_parallel_diag=True, blocked_prep=False, gram_grad_apart=True,
                                            bf16_grad_dots=True, gram_grad_warps=8),
    "kda_gram_apart_bf16_skb32": KernelVariant(token_parallel_diag=True, blocked_prep=False, gram_grad_apart=True,
                                               bf16_grad_dots=True, state_grad_key_block=32),
    # GDN's default with state_grad in key blocks of 32 (alone measured 3.61 against 3.87 ms at 12:00; never
    # with bf16 wy_grad products)
    "gdn_bf16_skb32": KernelVariant(bf16_grad_dots=True, state_grad_key_block=32),
    # KDA: the per-channel Gram products, diagonal blocks included, over nested halves in prep_blocked_kernel
    # (no diag kernel in the forward); on top of the per-channel default's token-parallel diagonal gradients
    "kda_nested": KernelVariant(token_parallel_diag=True, nested_grams=True),
    "kda_nested_w8": KernelVariant(token_parallel_diag=True, nested_grams=True, prep_warps=8),
    # the same with prep in two launches (Gram products and Tinv, then the column outputs from the stored Tinv)
    "kda_nested_split": KernelVariant(token_parallel_diag=True, nested_grams=True, split_prep=True),
    "kda_nested_split_w8": KernelVariant(token_parallel_diag=True, nested_grams=True, split_prep=True, prep_warps=8),
    # nested_grams' levels inside the diagonal blocks in tf32 (a third of its products; precision to check)
    "kda_nested_split_w8_tf32": KernelVariant(token_parallel_diag=True, nested_grams=True, split_prep=True,
                                              prep_warps=8, nested_diag_dots="tf32"),
    # KDA's token-parallel diagonals with blocked prep in two launches (no nested products)
    "kda_split_prep": KernelVariant(token_parallel_diag=True, split_prep=True),
    # GDN: the scalar decay's default with prep in two launches
    "gdn_split_prep": KernelVariant(bf16_grad_dots=True, split_prep=True),
    # ptxas: GDN's Gram-and-inverse launch fits 8 warps without spilling (584 B at 4)
    "gdn_split_prep_w8": KernelVariant(bf16_grad_dots=True, split_prep=True, prep_warps=8),
    # the forward alternatives above on the KDA default's backward (gram_grad_apart, bf16 wy_grad, key block 32)
    "kda_split_prep_ga": KernelVariant(token_parallel_diag=True, split_prep=True, gram_grad_apart=True,
                                       bf16_grad_dots=True, state_grad_key_block=32),
    "kda_split_prep_ga_c64": KernelVariant(token_parallel_diag=True, split_prep=True, gram_grad_apart=True,
                                           bf16_grad_dots=True, state_grad_key_block=32, prep_column_block=64),
    "gdn_split_prep_c64": KernelVariant(bf16_grad_dots=True, split_prep=True, prep_column_block=64),
    "kda_nested_split_w8_tf32_ga": KernelVariant(token_parallel_diag=True, nested_grams=True, split_prep=True,
                                                 prep_warps=8, nested_diag_dots="tf32", gram_grad_apart=True,
                                                 bf16_grad_dots=True, state_grad_key_block=32),
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
