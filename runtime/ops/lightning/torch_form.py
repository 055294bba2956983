"""Lightning attention (MiniMax) in the runtime: chunked form in fp32, the state carried between chunks.

Within a chunk of C tokens (local positions i, j):
  o_i = sum_{j<=i} exp(-s (i-j)) (q_i . k_j) v_j  +  exp(-s (i+1)) q_i^T S_in
  S_out = exp(-s L) S_in + sum_j exp(-s (L-1-j)) k_j v_j^T          (L = tokens in the chunk)
Every exponent is <= 0, so nothing overflows whatever the slope.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim, N chunks, C chunk size, X = N * C.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def lightning_attention(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    slope_H: torch.Tensor,
    initial_state_BHKV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_BTHV in q's dtype, final_state_BHKV in fp32) of S_t = exp(-slope) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t."""
    batch, num_tokens, num_heads, key_dim = q_BTHK.shape
    q_BHNCK, k_BHNCK, v_BHNCV = (_to_chunks(t) for t in (q_BTHK, k_BTHK, v_BTHV))
    slope_H = slope_H.float().to(q_BTHK.device)
    decays = _chunk_decays(slope_H, num_tokens, q_BHNCK.shape[2])
    if initial_state_BHKV is None:
        initial_state_BHKV = q_BHNCK.new_zeros(batch, num_heads, key_dim, v_BTHV.shape[-1])
    intra_BHNCV = (q_BHNCK @ k_BHNCK.transpose(-1, -2) * decays["intra_HCC"][:, None]) @ v_BHNCV
    # each chunk's own contribution to the state it hands on
    update_BHNKV = (k_BHNCK * decays["key_HNC"][..., None]).transpose(-1, -2) @ v_BHNCV
    states_in_BHNKV, final_BHKV = _scan_states(initial_state_BHKV.float(), update_BHNKV, decays["chunk_HN"])
    inter_BHNCV = (q_BHNCK * decays["query_HC"][:, None, :, None]) @ states_in_BHNKV
    o_BHXV = (intra_BHNCV + inter_BHNCV).flatten(2, 3)
    return o_BHXV[:, :, :num_tokens].transpose(1, 2).to(q_BTHK.dtype), final_BHKV


def _to_chunks(x_BTHK: torch.Tensor) -> torch.Tensor:
    """x_BHNCK in fp32, zero-padded at the end to whole chunks."""
    num_tokens = x_BTHK.shape[1]
    padded_BTHK = F.pad(x_BTHK.float(), (0, 0, 0, 0, 0, -num_tokens % CHUNK_SIZE))
    batch, padded_len, num_heads, dim = padded_BTHK.shape
    return padded_BTHK.view(batch, padded_len // CHUNK_SIZE, CHUNK_SIZE, num_heads, dim).permute(0, 3, 1, 2, 4)


def _chunk_decays(slope_H: torch.Tensor, num_tokens: int, num_chunks: int) -> dict[str, torch.Tensor]:
    """Decay factors; the last chunk may hold fewer than C tokens."""
    pos_C = torch.arange(CHUNK_SIZE, device=slope_H.device, dtype=torch.float32)
    length_N = (num_tokens - CHUNK_SIZE * torch.arange(num_chunks, device=slope_H.device)).clamp(max=CHUNK_SIZE).float()
    slope_H11 = slope_H[:, None, None]
    lag_CC = pos_C[:, None] - pos_C[None, :]
    # lags of future keys are masked to 0 before exp, then the factor is zeroed
    intra_HCC = torch.exp(-slope_H11 * lag_CC.clamp(min=0)) * (lag_CC >= 0)
    key_lag_NC = length_N[:, None] - 1 - pos_C[None, :]
    key_HNC = torch.exp(-slope_H11 * key_lag_NC.clamp(min=0)) * (key_lag_NC >= 0)
    return {
        "intra_HCC": intra_HCC,
        "query_HC": torch.exp(-slope_H[:, None] * (pos_C + 1)),
        "key_HNC": key_HNC,
        "chunk_HN": torch.exp(-slope_H[:, None] * length_N),
    }


def _scan_states(state_BHKV, update_BHNKV, chunk_decay_HN) -> tuple[torch.Tensor, torch.Tensor]:
    """states_in_BHNKV (the state entering each chunk) and the final state; one step per chunk."""
    states_in = []
    for n in range(update_BHNKV.shape[2]):
        states_in.append(state_BHKV)
        state_BHKV = chunk_decay_HN[:, n, None, None] * state_BHKV + update_BHNKV[:, :, n]
    return torch.stack(states_in, dim=2), state_BHKV
