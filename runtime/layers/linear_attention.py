"""Linear-attention layers: gated delta net (Qwen3-Next / Qwen3.5 layouts), KDA (Kimi), lightning (MiniMax).

Shape legend: B batch, T tokens, D model width, H heads (value heads for GDN), J key heads (GDN),
K key dim, V value dim, W conv width.
Parameter names are the release's leaf names, so the weight map is a rename.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import GatedDeltaConfig, KDAConfig, LightningConfig
from runtime.dispatch import op
from runtime.layers.norm import GatedRMSNorm, RMSNorm, Weight


class GatedDeltaNet(nn.Module):
    def __init__(self, config: GatedDeltaConfig, hidden_size: int, norm_eps: float):
        super().__init__()
        self.J, self.H = config.num_k_heads, config.num_v_heads
        self.K, self.V = config.head_k_dim, config.head_v_dim
        self.layout = config.fused_projections
        key, value = self.J * self.K, self.H * self.V
        if self.layout == "qkvz_ba":
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * key + 2 * value, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * self.H, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, 2 * key + value, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, value, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, self.H, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, self.H, bias=False)
        self.conv1d = Weight(2 * key + value, 1, config.conv_kernel_size)
        self.A_log = nn.Parameter(torch.zeros(self.H))
        self.dt_bias = nn.Parameter(torch.ones(self.H))
        self.norm = GatedRMSNorm(self.V, norm_eps)
        self.out_proj = nn.Linear(value, hidden_size, bias=False)

    def _projections(self, x_BTD):
        """(qkv_BTC in [q | k | v] channel order, z_BTHV, b_BTH, a_BTH)."""
        B, T, _ = x_BTD.shape
        if self.layout != "qkvz_ba":
            z = self.in_proj_z(x_BTD).view(B, T, self.H, self.V)
            return self.in_proj_qkv(x_BTD), z, self.in_proj_b(x_BTD), self.in_proj_a(x_BTD)
        # Qwen3-Next groups [q k v z] and [b a] per key head; regroup into contiguous q, k, v
        per = self.H // self.J
        qkvz = self.in_proj_qkvz(x_BTD).view(B, T, self.J, 2 * self.K + 2 * per * self.V)
        q, k, v, z = qkvz.split([self.K, self.K, per * self.V, per * self.V], dim=-1)
        b, a = self.in_proj_ba(x_BTD).view(B, T, self.J, 2 * per).split([per, per], dim=-1)
        qkv = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        return qkv, z.reshape(B, T, self.H, self.V), b.reshape(B, T, self.H), a.reshape(B, T, self.H)

    def forward(self, x_BTD: torch.Tensor, rotary=None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        qkv_BTC, z_BTHV, b_BTH, a_BTH = self._projections(x_BTD)
        qkv_BTC = op("causal_conv1d", x_BTD.device)(qkv_BTC, self.conv1d.weight.squeeze(1), None, "silu")
        q, k, v = qkv_BTC.split([self.J * self.K, self.J * self.K, self.H * self.V], dim=-1)
        # value heads share key heads in groups (GQA-like); the op takes one head count
        q_BTHK = q.view(B, T, self.J, self.K).repeat_interleave(self.H // self.J, dim=2)
        k_BTHK = k.view(B, T, self.J, self.K).repeat_interleave(self.H // self.J, dim=2)
        g_BTH = -self.A_log.float().exp() * F.softplus(a_BTH.float() + self.dt_bias)
        o_BTHV, _ = op("gated_delta_rule", x_BTD.device)(
            q_BTHK, k_BTHK, v.view(B, T, self.H, self.V), g_BTH, b_BTH.sigmoid(), use_qk_l2norm=True)
        return self.out_proj(self.norm(o_BTHV, z_BTHV).reshape(B, T, -1))


class KimiDeltaAttention(nn.Module):
    """KDA: per-channel decay from a low-rank forget gate; output gate through a low-rank projection."""

    def __init__(self, config: KDAConfig, hidden_size: int, norm_eps: float):
        super().__init__()
        self.H, self.K = config.num_heads, config.head_dim
        width, conv = self.H * self.K, config.conv_kernel_size
        self.separate_convs = config.separate_convs
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden_size, width, bias=False) for _ in range(3))
        if self.separate_convs:
            self.q_conv1d, self.k_conv1d, self.v_conv1d = (Weight(width, 1, conv) for _ in range(3))
        else:
            self.conv1d = Weight(3 * width, 1, conv)
        self.f_a_proj = nn.Linear(hidden_size, self.K, bias=False)
        self.f_b_proj = nn.Linear(self.K, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.H, 1))
        self.b_proj = nn.Linear(hidden_size, self.H, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, self.K, bias=False)
        self.g_b_proj = nn.Linear(self.K, width, bias=False)
        self.o_norm = GatedRMSNorm(self.K, norm_eps, config.output_gate_activation)
        self.o_proj = nn.Linear(width, hidden_size, bias=False)

    def _conv_weight(self) -> torch.Tensor:
        if self.separate_convs:
            return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)
        return self.conv1d.weight.squeeze(1)

    def forward(self, x_BTD: torch.Tensor, rotary=None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        qkv = torch.cat([self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)], dim=-1)
        qkv = op("causal_conv1d", x_BTD.device)(qkv, self._conv_weight(), None, "silu")
        q_BTHK, k_BTHK, v_BTHK = (t.view(B, T, self.H, self.K) for t in qkv.chunk(3, dim=-1))
        gate_in = self.f_b_proj(self.f_a_proj(x_BTD)).float() + self.dt_bias.float()
        g_BTHK = -self.A_log.float().exp() * F.softplus(gate_in.view(B, T, self.H, self.K))
        beta_BTH = torch.sigmoid(self.b_proj(x_BTD))
        o_BTHK, _ = op("kda", x_BTD.device)(q_BTHK, k_BTHK, v_BTHK, g_BTHK, beta_BTH, use_qk_l2norm=True)
        gate_BTHK = self.g_b_proj(self.g_a_proj(x_BTD)).view(B, T, self.H, self.K)
        return self.o_proj(self.o_norm(o_BTHK, gate_BTHK).reshape(B, T, -1))


class LightningAttention(nn.Module):
    """MiniMax: silu(qkv), decayed linear attention, RMSNorm, sigmoid output gate. The per-head decay
    slope is a release buffer (`slope_rate`, it depends on the layer's depth); the decay tables the
    release also stores are derived from it and kept only so the weight map is complete."""

    def __init__(self, config: LightningConfig, hidden_size: int, norm_eps: float):
        super().__init__()
        self.H, self.K, block = config.num_heads, config.head_dim, config.block_size
        width = self.H * self.K
        self.qkv_proj = nn.Linear(hidden_size, 3 * width, bias=False)
        self.output_gate = nn.Linear(hidden_size, width, bias=False)
        # MiniMax builds this norm with its default eps, not the config's
        self.norm = RMSNorm(width, 1e-6)
        self.out_proj = nn.Linear(width, hidden_size, bias=False)
        self.register_buffer("slope_rate", torch.zeros(self.H, 1, 1))
        for name, shape in (("query_decay", (self.H, block, 1)), ("key_decay", (self.H, block, 1)),
                            ("diagonal_decay", (1, self.H, block, block))):
            self.register_buffer(name, torch.zeros(shape), persistent=True)

    def forward(self, x_BTD: torch.Tensor, rotary=None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        qkv = F.silu(self.qkv_proj(x_BTD)).view(B, T, self.H, 3 * self.K)
        q_BTHK, k_BTHK, v_BTHK = qkv.split(self.K, dim=-1)
        o_BTHK, _ = op("lightning_attention", x_BTD.device)(q_BTHK, k_BTHK, v_BTHK, self.slope_rate.view(self.H))
        o_BTX = self.norm(o_BTHK.reshape(B, T, -1))
        return self.out_proj(torch.sigmoid(self.output_gate(x_BTD)) * o_BTX)
