"""Multi-head latent attention, dense (DeepSeek-V3, Kimi) or with the DSA indexer (DeepSeek-V3.2).

Shape legend: B batch, T tokens, D model width, H heads, N nope dim, R rope dim, V value dim,
L kv latent rank, I indexer heads, J indexer head dim, S selected keys.
The sparse path runs in the absorbed layout: queries are projected into the latent space so all
heads share one kv row of width L + R, and values are the latent itself, up-projected after.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.spec import DSAIndexer as DSAIndexerSpec, MLAAttention as MLAAttentionSpec
from runtime.dispatch import op
from runtime.model.layers.lora_linear import weight_of
from runtime.model.layers.norm import RMSNorm
from runtime.ops.mla.torch_form import mla_softmax_scale
from runtime.ops.rope.torch_form import apply_rope
from runtime.model.segments import per_segment


class DSAIndexer(nn.Module):
    def __init__(self, config: DSAIndexerSpec, hidden_size: int, q_in: int):
        super().__init__()
        self.I, self.J, self.topk = config.num_heads, config.head_dim, config.topk
        self.wq_b = nn.Linear(q_in, self.I * self.J, bias=False)
        self.wk = nn.Linear(hidden_size, self.J, bias=False)
        self.k_norm = nn.LayerNorm(self.J, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, self.I, bias=False)
        # Alignment pins a bf16 run's selection to the fp32 run's (as for MoE routing) and counts flips.
        self.pinned_idx: torch.Tensor | None = None
        self.last_selection: torch.Tensor | None = None

    @torch.no_grad()
    def forward(self, x_BTD, q_resid_BTQ, cos, sin, rope_dim: int) -> torch.Tensor:
        """idx_BTS: the top-k keys of each query; frozen under LoRA, so no graph is built."""
        B, T, _ = x_BTD.shape
        q_BTIJ = self.wq_b(q_resid_BTQ).view(B, T, self.I, self.J)
        k_BT1J = self.k_norm(self.wk(x_BTD)).unsqueeze(2)
        # the indexer rotates its first R channels in the half-split layout
        q_BTIJ, k_BT1J = apply_rope(q_BTIJ, cos, sin, False), apply_rope(k_BT1J, cos, sin, False)
        weights_BTI = self.weights_proj(x_BTD) * self.I**-0.5
        if self.pinned_idx is not None:
            return self.pinned_idx
        select = op("dsa_indexer", x_BTD.device)
        self.last_selection = select(q_BTIJ, k_BT1J[:, :, 0], weights_BTI, self.J**-0.5, self.topk)
        return self.last_selection


class MLAAttention(nn.Module):
    def __init__(self, config: MLAAttentionSpec, hidden_size: int, norm_eps: float):
        super().__init__()
        self.H, self.N, self.R, self.V = config.num_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.L, self.q_lora_rank, self.rope, self.eps = config.kv_lora_rank, config.q_lora_rank, config.rope, norm_eps
        qk = self.N + self.R
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden_size, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.H * qk, bias=False)
        else:
            self.q_proj = nn.Linear(hidden_size, self.H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, self.L + self.R, bias=False)
        self.kv_a_layernorm = RMSNorm(self.L, norm_eps)
        self.kv_b_proj = nn.Linear(self.L, self.H * (self.N + self.V), bias=False)
        self.o_proj = nn.Linear(self.H * self.V, hidden_size, bias=False)
        # Kimi K3's output gate: sigmoid(g_proj(x)) times the heads' output, before o_proj
        self.g_proj = nn.Linear(hidden_size, self.H * self.V, bias=False) if config.output_gate else None
        self.scale = config.scale or mla_softmax_scale(qk, self.rope.scaling if self.rope else None)
        self.indexer = DSAIndexer(config.indexer, hidden_size, self.q_lora_rank or hidden_size) if config.indexer else None

    def _cos_sin(self, x_BTD, rotary):
        if self.rope is None:  # NoPE MLA (Kimi): the rotation is the identity
            shape = (*x_BTD.shape[:2], self.R)
            return torch.ones(shape, device=x_BTD.device), torch.zeros(shape, device=x_BTD.device)
        return rotary.get(self.rope)

    def _weights(self) -> dict[str, torch.Tensor]:
        names = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "g_proj")
        params = {n: weight_of(getattr(self, n)) for n in names if getattr(self, n, None) is not None}
        params["kv_a_layernorm"] = self.kv_a_layernorm.weight
        if self.q_lora_rank:
            params["q_a_layernorm"] = self.q_a_layernorm.weight
        return params

    def forward(self, x_BTD: torch.Tensor, rotary, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Packed segments run one at a time (the MLA and DSA ops take no cu_seqlens)."""
        cos, sin = self._cos_sin(x_BTD, rotary)
        interleaved = bool(self.rope and self.rope.interleaved)
        if self.indexer is not None:
            return per_segment(lambda x, c, s: self._sparse(x, c, s, interleaved), cu_seqlens, x_BTD, cos, sin)
        attention, weights = op("mla_attention", x_BTD.device), self._weights()
        return per_segment(lambda x, c, s: attention(
            x, weights, num_heads=self.H, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.L, qk_nope_head_dim=self.N,
            qk_rope_head_dim=self.R, v_head_dim=self.V, cos_BTR=c, sin_BTR=s, scale=self.scale, eps=self.eps,
            interleaved_rope=interleaved), cu_seqlens, x_BTD, cos, sin)

    def _sparse(self, x_BTD, cos, sin, interleaved) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_resid_BTQ = self.q_a_layernorm(self.q_a_proj(x_BTD))
        q_BTHK = self.q_b_proj(q_resid_BTQ).view(B, T, self.H, self.N + self.R)
        latent_BTX = self.kv_a_proj_with_mqa(x_BTD)
        c_BTL = self.kv_a_layernorm(latent_BTX[..., : self.L])
        k_rot_BTR = apply_rope(latent_BTX[:, :, None, self.L:], cos, sin, interleaved)[:, :, 0]
        q_rot_BTHR = apply_rope(q_BTHK[..., self.N:], cos, sin, interleaved)
        w_kv_HXL = weight_of(self.kv_b_proj).view(self.H, self.N + self.V, self.L)
        # absorb the key up-projection into the query: q_nope . (W_uk c) = (W_uk^T q_nope) . c
        q_lat_BTHL = torch.einsum("bthn,hnl->bthl", q_BTHK[..., : self.N], w_kv_HXL[:, : self.N])
        q_abs_BTHK = torch.cat([q_lat_BTHL, q_rot_BTHR], dim=-1)
        kv_abs_BTK = torch.cat([c_BTL, k_rot_BTR], dim=-1)
        idx_BTS = self.indexer(x_BTD, q_resid_BTQ, cos, sin, self.R)
        o_lat_BTHL = op("dsa_attention", x_BTD.device)(q_abs_BTHK, kv_abs_BTK, idx_BTS, self.scale, self.L)
        o_BTHV = torch.einsum("bthl,hvl->bthv", o_lat_BTHL, w_kv_HXL[:, self.N:])
        o_BTX = o_BTHV.reshape(B, T, self.H * self.V)
        if self.g_proj is not None:
            o_BTX = o_BTX * torch.sigmoid(self.g_proj(x_BTD))
        return self.o_proj(o_BTX)
