"""Modeling code of the tiny Kimi K3-shaped example release: plain torch, written from the public description.

It plays the part of the code Moonshot ships with Kimi K3 (config.json's `auto_map`; transformers has no class
for it), so that onboarding a custom-code release of K3's shape can be exercised end to end at toy widths. It is
not Moonshot's code. Shapes: B batch, T tokens, D hidden, H heads, K head width, E experts, L latent width.

Followed from public sources (the release's config keys and tensor names, the Attention Residuals paper,
converters and serving code that document the release):
- text model under `language_model.` (`language_model.model.layers.N...`, `language_model.lm_head`), vision tower
  under `vision_tower.`, projector under `mm_projector.`;
- layers listed 1-based in `linear_attn_config.kda_layers` run Kimi Delta Attention (KDA), the others
  (`full_attn_layers`) gated MLA; the first `first_k_dense_replace` layers have a dense MLP, the rest a latent MoE;
- SiTU-GLU: `beta * tanh(gate / beta) * sigmoid(gate) * linear_beta * tanh(up / linear_beta)`;
- KDA: q/k/v projections through a causal depthwise conv + SiLU (fp32 conv weights), L2-normed q and k, per-channel
  decay `gate_lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias))` in log space, beta = sigmoid(b_proj),
  delta-rule state update, per-head RMSNorm of the output times sigmoid of the full-rank gate `g_proj`;
  `A_log` is stored zero-padded to the head width (as released: 128 entries, 96 heads), only the first H used;
- routed experts in MXFP4 where quantization_config says `mxfp4-pack-quantized` (compressed-tensors: weight_packed
  [out, in/2] uint8, low nibble first, weight_scale [out, in/32] uint8 E8M0), dequantized on each call and frozen;
- gated NoPE MLA: DeepSeek's low-rank q and kv with the rope part of the key left unrotated (no positions), the
  attention output multiplied by sigmoid(g_proj(x)) before o_proj;
- latent MoE: sigmoid router with a correction bias used for selection only (noaux_tc), top-k weights renormalized
  and scaled; a shared down-projection D -> L, routed SiTU experts w1/w3/w2 in the latent space, weighted sum,
  RMSNorm in the latent space (`latent_moe_use_norm`), up-projection L -> D; shared experts at full width
  (moe_intermediate_size x num_shared_experts), added after;
- block attention residuals: every sublayer's input is a softmax mix over the completed block sums and the current
  partial sum, scored by a per-sublayer pseudo-query (`*_res_proj`, [1, D]) against RMSNorm'd sources
  (`*_res_norm`); the embedding is the first block; the model's output is mixed the same way
  (`output_attn_res_*`) before the final norm.

Chosen here, not public (plausible; a real release may differ):
- the recurrent form of KDA (the release uses chunked kernels; the recurrence computes the same function);
- `attn_res_block_size` counts sublayers (attention and MLP), so a block spans attn_res_block_size / 2 layers;
- the MLA softmax scale is (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, the KDA scale K ** -0.5;
- the vision tower (MoonViT3d in the release) is a small ViT: conv patch embedding, fixed 2D sin-cos positions,
  pre-norm blocks (wqkv, wo, GELU MLP fc0/fc1), a final LayerNorm; the projector (patchmergerv2) LayerNorms each
  patch, concatenates 2x2 neighbours and maps them through Linear-GELU-Linear to the text width; image features
  replace the embeddings of `media_placeholder_token_id` tokens in order. Video (the temporal axis) is not modeled.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_kimi_k3 import KimiK3Config


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def situ_glu(gate, up, beta: float, linear_beta):
    """SiTU-GLU in fp32: a tanh-capped SiLU on the gate times a tanh-capped linear up projection."""
    gate32, up32 = gate.float(), up.float()
    activated = beta * torch.tanh(gate32 / beta) * torch.sigmoid(gate32)
    if linear_beta is not None:
        up32 = linear_beta * torch.tanh(up32 / linear_beta)
    return (activated * up32).to(gate.dtype)


class SiTUMLP(nn.Module):
    """Dense MLP and shared experts: gate_proj / up_proj / down_proj."""

    def __init__(self, config, dim: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, width, bias=False)
        self.up_proj = nn.Linear(dim, width, bias=False)
        self.down_proj = nn.Linear(width, dim, bias=False)
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta

    def forward(self, x):
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))


# e2m1 code -> value (sign bit 3), and the E8M0 exponent bias: the OCP microscaling (MX) formats
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_GROUP, E8M0_BIAS = 32, 127


def packed_experts(config) -> bool:
    """Whether the routed experts ship as compressed-tensors MXFP4 (quantization_config's pack format)."""
    quant = getattr(config, "quantization_config", None) or {}
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    return quant.get("format") == "mxfp4-pack-quantized"


class MXFP4Linear(nn.Module):
    """A frozen linear stored as released: weight_packed [out, in/2] uint8 (two e2m1 codes per byte, low nibble
    first) and weight_scale [out, in/32] uint8 (E8M0: 2^(s - 127) per 32 inputs); dequantized on each call."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // MX_GROUP, dtype=torch.uint8))

    def weight(self, dtype):
        lut = torch.tensor(E2M1, dtype=torch.float32, device=self.weight_packed.device)
        low, high = lut[(self.weight_packed & 0x0F).long()], lut[(self.weight_packed >> 4).long()]
        codes = torch.stack([low, high], dim=-1).flatten(-2)
        scale = torch.exp2(self.weight_scale.float() - E8M0_BIAS)
        return (codes.unflatten(-1, (-1, MX_GROUP)) * scale[..., None]).flatten(-2).to(dtype)

    def forward(self, x):
        return F.linear(x, self.weight(x.dtype))


class RoutedExpert(nn.Module):
    """One routed expert in the latent space: w1 (gate), w3 (up), w2 (down); MXFP4 where the release says so."""

    def __init__(self, config, latent: int, width: int):
        super().__init__()
        linear = MXFP4Linear if packed_experts(config) else (lambda i, o: nn.Linear(i, o, bias=False))
        self.w1, self.w3, self.w2 = linear(latent, width), linear(latent, width), linear(width, latent)
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta

    def forward(self, x):
        return self.w2(situ_glu(self.w1(x), self.w3(x), self.beta, self.linear_beta))


class MoEGate(nn.Module):
    """Sigmoid scores; the correction bias picks the experts but does not weight them (noaux_tc)."""

    def __init__(self, config):
        super().__init__()
        self.top_k, self.scale = config.num_experts_per_token, config.routed_scaling_factor
        self.renormalize = config.moe_renormalize
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x_TD):
        scores_TE = torch.sigmoid(F.linear(x_TD.float(), self.weight.float()))
        chosen_TK = torch.topk(scores_TE + self.e_score_correction_bias.float(), self.top_k, dim=-1).indices
        weights_TK = scores_TE.gather(-1, chosen_TK)
        if self.renormalize:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        return chosen_TK, weights_TK * self.scale


class LatentMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim, latent = config.hidden_size, config.routed_expert_hidden_size
        self.gate = MoEGate(config)
        self.routed_expert_down_proj = nn.Linear(dim, latent, bias=False)
        self.experts = nn.ModuleList(RoutedExpert(config, latent, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        self.routed_expert_norm = RMSNorm(latent, config.rms_norm_eps) if config.latent_moe_use_norm else None
        self.routed_expert_up_proj = nn.Linear(latent, dim, bias=False)
        self.shared_experts = SiTUMLP(config, dim, config.moe_intermediate_size * config.num_shared_experts)

    def forward(self, x):
        x_TD = x.reshape(-1, x.shape[-1])
        chosen_TK, weights_TK = self.gate(x_TD)
        latent_TL = self.routed_expert_down_proj(x_TD)
        mixed_TL = torch.zeros_like(latent_TL, dtype=torch.float32)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen_TK == e).nonzero(as_tuple=True)
            if rows.numel():
                out = expert(latent_TL[rows]).float() * weights_TK[rows, slot, None]
                mixed_TL = mixed_TL.index_add(0, rows, out)
        mixed_TL = mixed_TL.to(latent_TL.dtype)
        if self.routed_expert_norm is not None:
            mixed_TL = self.routed_expert_norm(mixed_TL)
        out_TD = self.routed_expert_up_proj(mixed_TL) + self.shared_experts(x_TD)
        return out_TD.reshape(x.shape)


class ShortConv(nn.Module):
    """Causal depthwise conv over time, then SiLU; the weight [C, 1, kernel] is kept in fp32 as released."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=torch.float32))

    def forward(self, x_BTC):
        padded = F.pad(x_BTC.float().transpose(1, 2), (self.kernel - 1, 0))
        out = F.conv1d(padded, self.weight.float(), groups=x_BTC.shape[-1])
        return F.silu(out).transpose(1, 2).to(x_BTC.dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        lin = config.linear_attn_config
        self.num_heads, self.head_dim = lin["num_heads"], lin["head_dim"]
        self.lower_bound = float(lin["gate_lower_bound"])
        dim, width, kernel = config.hidden_size, self.num_heads * self.head_dim, lin["short_conv_kernel_size"]
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, width, bias=False) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConv(width, kernel) for _ in range(3))
        self.f_a_proj = nn.Linear(dim, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.b_proj = nn.Linear(dim, self.num_heads, bias=False)
        # stored as released: one entry per head, zero-padded to the head width
        self.A_log = nn.Parameter(torch.zeros(max(self.head_dim, self.num_heads), dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        if not lin.get("use_full_rank_gate", True):
            raise ValueError("this release's KDA has a full-rank output gate (use_full_rank_gate)")
        self.g_proj = nn.Linear(dim, width, bias=False)
        self.o_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = nn.Linear(width, dim, bias=False)

    def _heads(self, x):
        return x.reshape(*x.shape[:-1], self.num_heads, self.head_dim)

    def forward(self, x_BTD):
        q = F.normalize(self._heads(self.q_conv1d(self.q_proj(x_BTD))).float(), dim=-1)
        k = F.normalize(self._heads(self.k_conv1d(self.k_proj(x_BTD))).float(), dim=-1)
        v = self._heads(self.v_conv1d(self.v_proj(x_BTD))).float()
        raw = self._heads(self.f_b_proj(self.f_a_proj(x_BTD))).float() + self._heads(self.dt_bias.float())
        decay = self.A_log[: self.num_heads].float().exp()[:, None]
        log_gate_BTHK = self.lower_bound * torch.sigmoid(decay * raw)
        beta_BTH = torch.sigmoid(self.b_proj(x_BTD).float())
        o_BTHK = kda_recurrent(q * self.head_dim ** -0.5, k, v, log_gate_BTHK, beta_BTH)
        gate = torch.sigmoid(self._heads(self.g_proj(x_BTD)).float())
        o_BTHK = self.o_norm(o_BTHK) * gate
        return self.o_proj(o_BTHK.flatten(-2).to(x_BTD.dtype))


def kda_recurrent(q, k, v, log_gate, beta):
    """Delta rule with per-channel decay, token by token. q, k, v, log_gate [B, T, H, K]; beta [B, T, H]."""
    B, T, H, K = q.shape
    state_BHKV = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        state_BHKV = state_BHKV * log_gate[:, t].exp()[..., None]
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], state_BHKV)
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        state_BHKV = state_BHKV + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state_BHKV))
    return torch.stack(outs, dim=1)


class GatedMLA(nn.Module):
    """MLA without rotary positions (the rope part of the key is shared and unrotated), sigmoid output gate."""

    def __init__(self, config):
        super().__init__()
        if not config.mla_use_nope:
            raise ValueError("this release's MLA runs without positions (mla_use_nope)")
        dim, self.num_heads = config.hidden_size, config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.q_a_proj = nn.Linear(dim, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(dim, self.num_heads * self.v_dim, bias=False) if config.mla_use_output_gate else None
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, dim, bias=False)

    def forward(self, x_BTD):
        B, T, _ = x_BTD.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD))).view(B, T, self.num_heads, -1)
        latent, k_shared = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, self.num_heads, -1)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_shared[:, :, None].expand(B, T, self.num_heads, self.rope)], dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=(self.nope + self.rope) ** -0.5)
        o_BTX = o.transpose(1, 2).reshape(B, T, -1)
        if self.g_proj is not None:
            o_BTX = o_BTX * torch.sigmoid(self.g_proj(x_BTD))
        return self.o_proj(o_BTX)


def attn_res_mix(sources, proj: nn.Linear, norm: RMSNorm):
    """Softmax over the sources (block sums, then the partial sum) of proj . norm(source); their weighted sum."""
    stacked = torch.stack(sources)
    logits = torch.einsum("d,n...d->n...", proj.weight[0].float(), norm(stacked).float())
    return torch.einsum("n...,n...d->...d", logits.softmax(0), stacked.float()).to(stacked.dtype)


class KimiK3DecoderLayer(nn.Module):
    def __init__(self, config, index: int):
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = KimiDeltaAttention(config) if config.is_kda_layer(index) else GatedMLA(config)
        if index < config.first_k_dense_replace:
            self.mlp = SiTUMLP(config, dim, config.intermediate_size)
        else:
            self.block_sparse_moe = LatentMoE(config)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.self_attention_res_proj, self.mlp_res_proj = nn.Linear(dim, 1, bias=False), nn.Linear(dim, 1, bias=False)
        self.self_attention_res_norm, self.mlp_res_norm = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.starts_block = index % max(1, config.attn_res_block_size // 2) == 0

    def forward(self, blocks: list, partial):
        h = attn_res_mix(blocks + [partial], self.self_attention_res_proj, self.self_attention_res_norm)
        if self.starts_block:
            blocks, partial = blocks + [partial], None
        attn = self.self_attn(self.input_layernorm(h))
        partial = attn if partial is None else partial + attn
        h = attn_res_mix(blocks + [partial], self.mlp_res_proj, self.mlp_res_norm)
        ffn = self.mlp if hasattr(self, "mlp") else self.block_sparse_moe
        return blocks, partial + ffn(self.post_attention_layernorm(h))


class KimiK3TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(KimiK3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
        self.output_attn_res_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, inputs_embeds):
        blocks, partial = [], inputs_embeds
        for layer in self.layers:
            blocks, partial = layer(blocks, partial)
        return self.norm(attn_res_mix(blocks + [partial], self.output_attn_res_proj, self.output_attn_res_norm))


class KimiK3LanguageModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = KimiK3TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class VisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim, self.num_heads = config.vt_hidden_size, config.vt_num_attention_heads
        self.norm0, self.norm1 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wqkv, self.wo = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.ModuleDict({"fc0": nn.Linear(dim, config.vt_intermediate_size),
                                  "fc1": nn.Linear(config.vt_intermediate_size, dim)})

    def forward(self, x_NPD):
        N, P, D = x_NPD.shape
        q, k, v = self.wqkv(self.norm0(x_NPD)).view(N, P, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(N, P, D)
        x_NPD = x_NPD + self.wo(attn)
        return x_NPD + self.mlp["fc1"](F.gelu(self.mlp["fc0"](self.norm1(x_NPD))))


class VisionTower(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.patch_size, dim = config.patch_size, config.vt_hidden_size
        self.patch_embed = nn.ModuleDict({"proj": nn.Conv2d(3, dim, config.patch_size, stride=config.patch_size)})
        self.encoder = nn.ModuleDict({"blocks": nn.ModuleList(VisionBlock(config)
                                                              for _ in range(config.vt_num_hidden_layers)),
                                      "final_layernorm": nn.LayerNorm(dim)})

    def forward(self, pixels_NCHW):
        grid = self.patch_embed["proj"](pixels_NCHW)
        N, D, h, w = grid.shape
        x = grid.flatten(2).transpose(1, 2) + sincos_2d(h, w, D).to(grid.dtype)
        for block in self.encoder["blocks"]:
            x = block(x)
        return self.encoder["final_layernorm"](x).view(N, h, w, D)


def sincos_2d(h: int, w: int, dim: int):
    """Fixed positions: half the channels encode the row, half the column."""
    quarter = dim // 4
    freqs = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float32) / quarter)
    rows = torch.arange(h, dtype=torch.float32)[:, None] * freqs
    cols = torch.arange(w, dtype=torch.float32)[:, None] * freqs
    row_emb = torch.cat([rows.sin(), rows.cos()], -1)[:, None].expand(h, w, 2 * quarter)
    col_emb = torch.cat([cols.sin(), cols.cos()], -1)[None].expand(h, w, 2 * quarter)
    return torch.cat([row_emb, col_emb], -1).reshape(h * w, 4 * quarter)


class PatchMerger(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.kh, self.kw = config.merge_kernel_size
        merged = config.mm_hidden_size * self.kh * self.kw
        self.pre_norm = nn.LayerNorm(config.mm_hidden_size)
        self.proj = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, config.text_hidden_size))

    def forward(self, x_NhwD):
        N, h, w, D = x_NhwD.shape
        x = self.pre_norm(x_NhwD).view(N, h // self.kh, self.kh, w // self.kw, self.kw, D)
        return self.proj(x.permute(0, 1, 3, 2, 4, 5).reshape(-1, self.kh * self.kw * D))


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3Config
    base_model_prefix = "language_model"
    _no_split_modules = ["KimiK3DecoderLayer", "VisionBlock"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, (RMSNorm, nn.LayerNorm)):
            nn.init.ones_(module.weight)
        elif isinstance(module, ShortConv):
            nn.init.normal_(module.weight, std=module.kernel ** -0.5)
        elif isinstance(module, MoEGate):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, KimiDeltaAttention):
            with torch.no_grad():
                module.A_log.zero_()
                module.A_log[: module.num_heads] = torch.linspace(0.0, 1.0, module.num_heads).log1p()
                module.dt_bias.zero_()


class KimiK3ForConditionalGeneration(KimiK3PreTrainedModel):
    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        self.language_model = KimiK3LanguageModel(config.text_config)
        self.vision_tower = VisionTower(config.vision_config)
        self.mm_projector = PatchMerger(config.vision_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.model.embed_tokens

    def forward(self, input_ids=None, pixel_values=None, labels=None, attention_mask=None, inputs_embeds=None,
                **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.language_model.model.embed_tokens(input_ids)
        if pixel_values is not None:
            inputs_embeds = self._with_images(input_ids, inputs_embeds, pixel_values)
        logits = self.language_model.lm_head(self.language_model.model(inputs_embeds)).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _with_images(self, input_ids, embeds, pixel_values):
        features = self.mm_projector(self.vision_tower(pixel_values.to(embeds.dtype))).to(embeds.dtype)
        slots = input_ids == self.config.media_placeholder_token_id
        if int(slots.sum()) != features.shape[0]:
            raise ValueError(f"{int(slots.sum())} image placeholder tokens for {features.shape[0]} image features")
        return embeds.masked_scatter(slots[..., None], features)
