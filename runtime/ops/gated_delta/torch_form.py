"""Gated delta rule (GDN) in the runtime: chunked torch form, differentiable by autograd; KDA's
(runtime/ops/gated_delta/kda_torch_form.py) is the same form with a per-channel decay.

Within a chunk of C tokens (local positions i, j), with gc the in-chunk cumulative log decay,
q, k already l2-normalized and q scaled, and h the state entering the chunk:
  L_ij = beta_i sum_d k_id k_jd exp(gc_id - gc_jd)   (j < i)     Tinv = (I + L)^-1   (the UT transform)
  w = Tinv (beta k exp(gc)),  u = Tinv (beta v),   v_new = u - w h
  P_ij = sum_d q_id k_jd exp(gc_id - gc_jd)          (j <= i)
  o = (q exp(gc)) h + P v_new,   h_next = exp(gc_last) h + (k exp(gc_last - gc))^T v_new
Every exponent above is <= 0, so nothing overflows whatever the decay. The state is carried in fp32
(fp64 when the inputs are fp64, which makes this form a fast fp64 reference on the GPU).

Shape legend: B batch, T tokens, H heads, K key dim, V value dim, N packed sequences, C chunk size.
Tensors inside are [B, H, T, ...]; per-channel decays g_BHTK (KDA), scalar ones g_BHT1 (GDN).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# Log-decay forms by the spec's gated-delta `decay` name: op(a_BTH, A_log_H, dt_bias_H) -> g_BTH <= 0, in fp32;
# a package's generated forms are added when it loads (runtime/package_ops.py)
DECAYS: dict[str, Callable] = {
    "softplus": lambda a_BTH, A_log_H, dt_bias_H: -A_log_H.float().exp() * F.softplus(a_BTH.float() + dt_bias_H),
}

CHUNK_SIZE = 64


def gated_delta_rule(
    q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, scale=None, initial_state_BHKV=None, use_qk_l2norm=True, cu_seqlens=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_BTHV in q's dtype, final_state_BHKV in fp32) of the GDN recurrence in docs/ops.md."""
    return chunked_delta_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH[..., None], beta_BTH, scale, initial_state_BHKV,
                              use_qk_l2norm, cu_seqlens)


def chunked_delta_rule(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, cu_seqlens):
    """(o, final state) of the chunked form for a log decay g [B, T, H, 1] (GDN) or [B, T, H, K] (KDA); runs each
    packed sequence on its own."""
    if cu_seqlens is None:
        return _chunked(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs batch 1, got q of shape {tuple(q.shape)}")
    outputs, finals = [], []
    bounds = cu_seqlens.tolist()
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        piece = [t[:, start:end] for t in (q, k, v, g, beta)]
        state = None if initial_state is None else initial_state[n : n + 1]
        o, final = _chunked(*piece, scale, state, use_qk_l2norm)
        outputs.append(o)
        finals.append(final)
    return torch.cat(outputs, dim=1), torch.cat(finals, dim=0)


def _chunked(q_BTHK, k_BTHK, v_BTHV, g_BTHX, beta_BTH, scale, initial_state_BHKV, use_qk_l2norm):
    """One sequence per batch row; X is 1 (GDN) or K (KDA)."""
    compute = torch.float64 if q_BTHK.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (t.transpose(1, 2).to(compute) for t in (q_BTHK, k_BTHK, v_BTHV, g_BTHX, beta_BTH))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    num_tokens = q.shape[2]
    q, k, v, g, beta = (_to_chunks(t) for t in (q, k, v, g, beta[..., None]))
    batch, num_heads, num_chunks = q.shape[:3]
    h = q.new_zeros(batch, num_heads, q.shape[-1], v.shape[-1])
    if initial_state_BHKV is not None:
        h = initial_state_BHKV.to(compute)
    outputs = []
    for n in range(num_chunks):
        o, h = _chunk_step(q[:, :, n], k[:, :, n], v[:, :, n], g[:, :, n].cumsum(-2), beta[:, :, n], h)
        outputs.append(o)
    o_BHTV = torch.cat(outputs, dim=2)[:, :, :num_tokens]
    return o_BHTV.transpose(1, 2).to(q_BTHK.dtype), h if compute == torch.float64 else h.float()


def _chunk_step(q_BHCK, k_BHCK, v_BHCV, gc_BHCX, beta_BHC1, h_BHKV):
    """(o_BHCV, h_next_BHKV) of one chunk; gc is the in-chunk cumulative log decay."""
    size = q_BHCK.shape[2]
    strict = torch.ones(size, size, dtype=torch.bool, device=q_BHCK.device).tril(-1)
    eye = torch.eye(size, dtype=q_BHCK.dtype, device=q_BHCK.device)
    L_BHCC = beta_BHC1 * _decayed_gram(k_BHCK, k_BHCK, gc_BHCX, strict)
    lhs_BHCC = eye + L_BHCC
    w_BHCK = torch.linalg.solve_triangular(lhs_BHCC, beta_BHC1 * k_BHCK * gc_BHCX.exp(), upper=False, unitriangular=True)
    u_BHCV = torch.linalg.solve_triangular(lhs_BHCC, beta_BHC1 * v_BHCV, upper=False, unitriangular=True)
    v_new_BHCV = u_BHCV - w_BHCK @ h_BHKV
    P_BHCC = _decayed_gram(q_BHCK, k_BHCK, gc_BHCX, strict | eye.bool())
    o_BHCV = (q_BHCK * gc_BHCX.exp()) @ h_BHKV + P_BHCC @ v_new_BHCV
    gc_last_BH1X = gc_BHCX[:, :, -1:]
    k_to_end_BHCK = k_BHCK * (gc_last_BH1X - gc_BHCX).exp()
    h_next_BHKV = gc_last_BH1X.transpose(-1, -2).exp() * h_BHKV + k_to_end_BHCK.transpose(-1, -2) @ v_new_BHCV
    return o_BHCV, h_next_BHKV


def _decayed_gram(a_BHCK, b_BHCK, gc_BHCX, mask_CC):
    """M_ij = sum_d a_id b_jd exp(gc_id - gc_jd) where mask (i >= j), else 0: exponents stay <= 0."""
    diff_BHCCX = gc_BHCX[:, :, :, None, :] - gc_BHCX[:, :, None, :, :]
    decay_BHCCX = diff_BHCCX.masked_fill(~mask_CC[:, :, None], float("-inf")).exp()
    if gc_BHCX.shape[-1] == 1:
        return (a_BHCK @ b_BHCK.transpose(-1, -2)) * decay_BHCCX[..., 0]
    return torch.einsum("bhik,bhjk,bhijk->bhij", a_BHCK, b_BHCK, decay_BHCCX)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as fla."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _to_chunks(x_BHTX: torch.Tensor) -> torch.Tensor:
    """x_BHNCX zero-padded at the end to whole chunks (zero k, v, beta and g leave the state unchanged)."""
    num_tokens = x_BHTX.shape[2]
    padded = F.pad(x_BHTX, (0, 0, 0, -num_tokens % CHUNK_SIZE))
    return padded.unflatten(2, (-1, CHUNK_SIZE))
