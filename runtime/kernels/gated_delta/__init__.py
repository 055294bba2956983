"""Fused Triton kernels for the gated delta rule (GDN, scalar decay) and KDA (per-channel decay).

Same signatures and return values as reference_ops/gated_delta.py and reference_ops/kda.py:
o in q's dtype, final state in fp32. Inputs bf16 or fp32; accumulation and state in fp32.
function.py launches the kernels of forward.py, diagonal.py and backward.py (helpers in common.py).
"""
from runtime.kernels.gated_delta.function import chunk_delta_rule

# one entry for both: g's shape picks the decay, g_BTH per head and token (GDN) or g_BTHK per key channel too (KDA)
gated_delta_rule = kda = chunk_delta_rule
