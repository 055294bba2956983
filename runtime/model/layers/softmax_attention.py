"""Softmax attention layer: GQA, rope (full/partial), qk-norm, sliding window, sinks, sigmoid output gate.

Shape legend: B batch, T tokens, D model width, H query heads, G kv heads, K head dim.
Parameter names are the release's leaf names (q_proj, k_norm, sinks...), so the weight map is a rename.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.spec import SoftmaxAttention as SoftmaxAttentionSpec
from runtime.dispatch import op
from runtime.model.layers.norm import RMSNorm
from runtime.ops.rope.torch_form import apply_rope
from runtime.model.segments import per_segment


class SoftmaxAttention(nn.Module):
    def __init__(self, config: SoftmaxAttentionSpec, hidden_size: int, norm_eps: float, norm_offset: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.rope, self.window, self.output_gate = config.rope, config.sliding_window, config.output_gate
        self.qk_norm = config.qk_norm
        self.scale = config.scale or self.head_dim**-0.5
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, q_width * (2 if self.output_gate else 1), bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden_size, kv_width, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden_size, kv_width, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_width, hidden_size, bias=config.o_bias)
        if self.qk_norm != "none":
            full = self.qk_norm == "full"
            self.q_norm = RMSNorm(q_width if full else self.head_dim, norm_eps, norm_offset)
            self.k_norm = RMSNorm(kv_width if full else self.head_dim, norm_eps, norm_offset)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.sinks else None

    def forward(self, x_BTD: torch.Tensor, rotary, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q, gate_BTX = self._queries(x_BTD)
        k = self.k_proj(x_BTD)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q_BTHK, k_BTGK = q.view(B, T, self.num_heads, self.head_dim), k.view(B, T, self.num_kv_heads, self.head_dim)
        v_BTGK = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        if self.rope is not None:
            cos, sin = rotary.get(self.rope)
            q_BTHK = apply_rope(q_BTHK, cos, sin, self.rope.interleaved)
            k_BTGK = apply_rope(k_BTGK, cos, sin, self.rope.interleaved)
        attention = op("softmax_attention", x_BTD.device)
        o_BTHK = per_segment(lambda q_, k_, v_: attention(q_, k_, v_, self.scale, causal=True, window=self.window,
                                                         sinks_H=self.sinks), cu_seqlens, q_BTHK, k_BTGK, v_BTGK)
        o_BTX = o_BTHK.reshape(B, T, -1)
        if gate_BTX is not None:
            o_BTX = o_BTX * torch.sigmoid(gate_BTX)
        return self.o_proj(o_BTX)

    def _queries(self, x_BTD):
        q = self.q_proj(x_BTD)
        if not self.output_gate:
            return q, None
        # Qwen3-Next packs [query | gate] per head in q_proj's output
        B, T, _ = x_BTD.shape
        q_BTH2K = q.view(B, T, self.num_heads, 2 * self.head_dim)
        query, gate = q_BTH2K.chunk(2, dim=-1)
        return query.reshape(B, T, -1), gate.reshape(B, T, -1)
