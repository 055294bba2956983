"""The hybrid decoder, assembled from a ModelSpec (runtime/spec.py, read from the package's spec.json).

Single-device and readable: embedding, per layer (pre-norm attention of any registered kind, pre-norm
dense or MoE FFN, residuals), final norm, LM head. Parallelism is applied from outside.
Shape legend: B batch, T tokens, D model width, X vocabulary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.spec import AttnResSpec, LayerSpec, ModelSpec, NormSpec, read_spec
from runtime.model.layers.attn_res import AttnResMix, starts_block
from runtime.model.layers.ffn import GatedMLP, MoE
from runtime.model.layers.linear_attention import GatedDeltaNet, KimiDeltaAttention, LightningAttention
from runtime.model.layers.lora_linear import weight_of
from runtime.model.layers.mla import MLAAttention
from runtime.model.layers.norm import make_norm
from runtime.model.layers.softmax_attention import SoftmaxAttention
from runtime.model.loss import capped
from runtime.ops.residual.torch_form import mix
from runtime.model.own_modules import OwnModel, OwnModule
from runtime.model.rotary import RotaryCache

ATTENTION_CLASSES = {"softmax": SoftmaxAttention, "mla": MLAAttention, "gated_delta": GatedDeltaNet,
                     "kda": KimiDeltaAttention, "lightning": LightningAttention}


def _attention(attention, index: int, d: int, eps: float, offset: float) -> nn.Module:
    if attention.kind == "own_module":
        return OwnModule(index, "attn", attention.path)
    if attention.kind == "softmax":
        return SoftmaxAttention(attention, d, eps, offset)
    return ATTENTION_CLASSES[attention.kind](attention, d, eps)


def _ffn(ffn, index: int, d: int, eps: float) -> nn.Module:
    if ffn.kind == "own_module":
        return OwnModule(index, "ffn", ffn.path)
    return MoE(ffn, d, eps) if ffn.kind == "moe" else GatedMLP(d, ffn.intermediate_size, ffn.activation, ffn.situ_betas)


class DecoderLayer(nn.Module):
    def __init__(self, layer: LayerSpec, hidden_size: int, norm: NormSpec, index: int = 0,
                 attn_res: AttnResSpec | None = None):
        super().__init__()
        d, eps, offset = hidden_size, norm.eps, norm.offset
        # a layer not understood as a whole is transformers' decoder layer, norms and residuals included
        self.own = OwnModule(index, "layer", "") if layer.own_layer else None
        # readers of layer.attn / layer.ffn (metrics, memory policy) see no part of ours in an own layer
        self.attn = self.ffn = None
        if self.own is None:
            self.input_layernorm = make_norm(d, norm)
            self.post_attention_layernorm = make_norm(d, norm)
            self.attn = _attention(layer.attention, index, d, eps, offset)
            self.ffn = _ffn(layer.ffn, index, d, eps)
        self.residual = layer.residual
        # block attention residuals (Kimi K3): the sublayers read a mix of the stream's sources (attn_res.py)
        self.attn_mix = self.ffn_mix = None
        self.starts_block = False
        if attn_res is not None:
            if self.own is not None:
                raise NotImplementedError("block attention residuals around a layer of the model's own")
            self.attn_mix, self.ffn_mix = AttnResMix(d, norm), AttnResMix(d, norm)
            self.starts_block = starts_block(attn_res, index)

    def forward(self, h_BTD, rotary: RotaryCache, cu_seqlens: torch.Tensor | None = None):
        """h_BTD: the hidden state; with block attention residuals, the stream's sources (completed blocks, then the
        partial sum) as a tuple, and the layer returns the new tuple."""
        if self.attn_mix is not None:
            return self._forward_attn_res(h_BTD, rotary, cu_seqlens)
        if self.own is not None:
            return self.own(h_BTD, rotary, cu_seqlens)
        r = self.residual
        normed_BTD = self.input_layernorm(h_BTD)
        skip_BTD = normed_BTD if r.skip_from_normed else h_BTD
        h_BTD = mix(r.mixing, skip_BTD, self.attn(normed_BTD, rotary, cu_seqlens), r.attn_alpha, r.attn_beta)
        normed_BTD = self.post_attention_layernorm(h_BTD)
        skip_BTD = normed_BTD if r.skip_from_normed else h_BTD
        return mix(r.mixing, skip_BTD, self.ffn(normed_BTD), r.ffn_alpha, r.ffn_beta)

    def _forward_attn_res(self, sources: tuple[torch.Tensor, ...], rotary: RotaryCache, cu_seqlens):
        blocks, partial = sources[:-1], sources[-1]
        h_BTD = self.attn_mix(sources)
        attn = self.attn(self.input_layernorm(h_BTD), rotary, cu_seqlens)
        # a layer that starts a block closes the partial sum into the blocks; its attention starts the next one
        blocks, partial = ((*blocks, partial), attn) if self.starts_block else (blocks, partial + attn)
        h_BTD = self.ffn_mix((*blocks, partial))
        return (*blocks, partial + self.ffn(self.post_attention_layernorm(h_BTD)))


class HybridDecoder(nn.Module):
    # set by runtime/memory.py's apply_memory_policy when it offloads saved activations to host memory
    offloads_activations = False

    def __init__(self, config: ModelSpec | dict, num_layers: int | None = None):
        """config: a ModelSpec, or spec.json's data (validated here, once, by read_spec: SpecError if malformed).
        num_layers truncates the model (alignment of very large releases runs the first few)."""
        super().__init__()
        if not isinstance(config, ModelSpec):
            config = read_spec(config)
        self.config = config
        d, vocab, norm = config.hidden_size, config.vocab_size, config.norm
        # a model whose glue is not understood is transformers' whole model: no layers, embedding or head of ours
        self.own = OwnModel(num_layers) if config.own_model else None
        if self.own is not None:
            self.layers, self.embed_tokens, self.lm_head = nn.ModuleList(), None, None
            return
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(DecoderLayer(layer, d, norm, i, config.attn_res)
                                    for i, layer in enumerate(config.layers[:num_layers]))
        self.norm = make_norm(d, norm)
        # block attention residuals: the final norm reads a mix of the stream's sources too
        self.output_mix = AttnResMix(d, norm) if config.attn_res is not None else None
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(d, vocab, bias=False)

    def hidden_states(self, input_ids_BT: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                      inputs_embeds_BTD: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None):
        """h_BTD after the final norm. positions: [B, T], or [3, B, T] for multimodal rope (default 0..T-1).
        cu_seqlens (batch 1): packed segments, which never attend to or carry state from one another."""
        if self.own is not None:
            return self.own.hidden_states(input_ids_BT, positions, inputs_embeds_BTD, cu_seqlens)
        h_BTD = self.embed_tokens(input_ids_BT) if inputs_embeds_BTD is None else inputs_embeds_BTD
        if positions is None:
            positions = torch.arange(h_BTD.shape[1], device=h_BTD.device).expand(h_BTD.shape[0], -1)
        rotary = RotaryCache(positions)
        # with block attention residuals the stream is its sources, the embedding the first partial sum
        h = (h_BTD,) if self.output_mix is not None else h_BTD
        for layer in self.layers:
            h = layer(h, rotary, cu_seqlens)
        return self.norm(self.output_mix(h) if self.output_mix is not None else h)

    def head_weight(self) -> torch.Tensor:
        """w_XD of the LM head (the embedding when tied)."""
        if self.own is not None:
            return weight_of(self.own.head())
        return self.embed_tokens.weight if self.lm_head is None else weight_of(self.lm_head)

    def forward(self, input_ids_BT: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                inputs_embeds_BTD: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """logits_BTX in fp32 (training takes hidden_states and runtime.model.loss instead: no [T, X] logits)."""
        h_BTD = self.hidden_states(input_ids_BT, positions, inputs_embeds_BTD, cu_seqlens)
        return capped(F.linear(h_BTD, self.head_weight()).float(), self.config.final_logit_softcapping)[0]


def causal_lm_loss(logits_BTX: torch.Tensor, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (the last position predicts nothing)."""
    return F.cross_entropy(logits_BTX[:, :-1].reshape(-1, logits_BTX.shape[-1]), input_ids_BT[:, 1:].reshape(-1))
