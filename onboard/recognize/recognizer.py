"""Manifest -> ModelSpec: recognition from config keys and weight names.

Config keys say the widths; weight names say which modules exist (biases, norms, gates, layouts).
Family knowledge is limited to what a config cannot express (e.g. Qwen3-Next's (1 + w) norms);
everything else comes from keys any release of the same design would use, so an unknown family
(the seed-2.8t example) is recognized from keys and names alone. What is not understood is kept in
`unrecognized`.
"""
from __future__ import annotations

import re

from onboard.errors import BadInput
from onboard.recognize.meta_check import rope_pairs_interleaved, transformers_layer_count
from onboard.release.config_view import ConfigView, NotRecognized
from onboard.release.manifest import Manifest
from onboard.release.naming import detect_naming, scan_layers
from runtime.spec import (WeightNaming, DenseFFN, DSAIndexer, GatedDeltaAttention, KDAAttention, LayerSpec,
                          LightningAttention, MLAAttention, ModelSpec, MoEFFN, NormSpec, OwnModule, ResidualSpec,
                          RopeSpec, RouterSpec, SoftmaxAttention, Unrecognized)
from onboard.recognize import param_count, vision as recognize_vision
from onboard.recognize.mrope import probed_mrope
from onboard.release.transformers_classes import transformers_knows

# Families whose RMSNorm applies (1 + w): not expressed in their configs.
ONE_PLUS_W_NORM_FAMILIES = {"qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"}
# Families whose softmax attention has a sigmoid output gate folded into q_proj.
GATED_ATTENTION_FAMILIES = {"qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"}
# Families whose softmax attention rotates interleaved channel pairs (GLM-style), not halves.
INTERLEAVED_ROPE_FAMILIES = {"ernie4_5_moe"}
# Families whose residual skips from the normed block input (post-norm style), with scale factors.
NORMED_SKIP_FAMILIES = {"minimax"}
# Families whose MLA runs without rotary embedding (NoPE).
NOPE_MLA_FAMILIES = {"kimi_linear"}

# mlp_layer_types entries: whether the layer's FFN is MoE.
MLP_LAYER_KINDS = {"sparse": True, "dense": False}
# attn_type_list entries (MiniMax): 1 softmax attention, 0 linear attention.
ATTN_TYPE_FLAGS = {1: "full_attention", 0: "linear_attention"}

KNOWN_TOPK_METHODS = {None, "greedy", "group_limited_greedy", "noaux_tc"}

INDEX_RE = re.compile(r"\.\d+\.")
# tensors only a linear attention (a decay and short convolutions) holds
LINEAR_ATTENTION_TENSORS = r"\.(A_log|dt_bias)$|conv1d\.weight$"

LAYER_KIND_ALIASES = {
    "full_attention": "full", "attention": "full", "global_attention": "full",
    "sliding_attention": "sliding", "local_attention": "sliding",
    "linear_attention": "linear",
    "sparse_attention": "sparse", "indexed_attention": "sparse",
}


def declared_activation(text_config: dict) -> tuple[str, dict]:
    """(hidden_act, its parameters: the `activation_<name>_*` keys, e.g. SiTU's activation_situ_beta)."""
    name = str(text_config.get("hidden_act") or "silu")
    return name, {k: v for k, v in text_config.items() if k.startswith(f"activation_{name}_")}


class Recognizer:
    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        config_path = str(manifest.root / "config.json")
        has_text = manifest.text_config is not manifest.config
        self.top = ConfigView(manifest.config, config_path, "")
        # one view when the text settings sit at the top level, so each key is judged once
        self.cfg = ConfigView(manifest.text_config, config_path, self._text_key()) if has_text else self.top
        if has_text:
            self.top.used.add(self._text_key())
        self.family = str(manifest.config.get("model_type", "unknown"))
        self.names = list(manifest.tensors)
        scan = scan_layers(self.names)
        self.naming: WeightNaming = detect_naming(self.names, scan)
        self.suffixes = scan[1]  # per layer, expert indices collapsed to N
        self.unrecognized: list[Unrecognized] = []

    def _text_key(self) -> str:
        for key in ("text_config", "language_config", "llm_config"):
            if key in self.manifest.config:
                return key
        return "text_config"

    def run(self) -> ModelSpec:
        hidden = self.cfg.positive_int("hidden_size", "d_model", "n_embd")
        num_layers = self.num_layers()
        kinds = self.layer_kinds(num_layers)
        moe_layers = self.moe_layer_flags(num_layers)
        if all(flag is True for flag in moe_layers):
            self.cfg.mark_used("intermediate_size")  # the dense width, unused when every layer is MoE
        layers = [LayerSpec(index=i, attention=self._component(i, "attention", self.attention, i, kinds[i]),
                            ffn=self._component(i, "ffn", self.ffn, i, moe_layers[i]),
                            residual=self.residual(kinds[i])) for i in range(num_layers)]
        vision = self.vision()
        self.attention_residuals()
        self.stored_format()
        tie = bool(self.cfg.get("tie_word_embeddings", default=self.top.get("tie_word_embeddings", default=False)))
        fields = dict(family=self.family, architecture=self._architecture(), hidden_size=hidden,
                      vocab_size=self.cfg.positive_int("vocab_size"), num_layers=num_layers, layers=layers,
                      norm=self.norm(), tie_word_embeddings=tie, final_logit_softcapping=self.logit_softcap(),
                      naming=self.naming, vision=vision,
                      dtype=str(self.manifest.config.get("torch_dtype") or self.manifest.config.get("dtype") or "bfloat16"))
        counts = param_count.count(ModelSpec.model_construct(**fields, params=None), vision)
        self.collect_unrecognized()
        unique = list({(u.source, u.item): u for u in self.unrecognized}.values())
        return ModelSpec(**fields, params=counts, unrecognized=unique)

    def vision(self):
        """The vision tower as recognized; None, noted, when its config is not read as our tower's: image inputs
        are then not supported, and the text path onboards without them."""
        try:
            return recognize_vision.recognize(self.manifest, self.top, self.naming)
        except NotRecognized as gap:
            # the image token belongs to the tower that is not supported
            self.top.mark_used(*recognize_vision.IMAGE_TOKEN_KEYS)
            self.unrecognized.append(Unrecognized(source=f"config.json:{gap.key}", item="vision tower not understood",
                                                  detail=f"{gap}: image inputs not supported, the text path only"))
            return None

    def attention_residuals(self) -> None:
        """Block attention residuals (Kimi's AttnRes): named where a key or the layers' pseudo-query tensors show them.
        The runtime's decoder layers add into one residual stream; these tensors then make each layer its own."""
        size = self.cfg.positive_int("attn_res_block_size", default=None)
        found = sorted({s for layer in self.suffixes.values() for s in layer if re.search(r"_res_(proj|norm)\.weight$", s)})
        if size is None and not found:
            return
        self.unrecognized.append(Unrecognized(
            source=self.config_source("attn_res_block_size"), item="block attention residuals",
            detail=f"attn_res_block_size={size}: each sublayer's input is a softmax mix over the sums of earlier blocks "
                   f"of layers, scored by per-layer pseudo-queries ({', '.join(found) or 'no tensors found'}), not one "
                   "residual stream; the runtime's decoder layers add into one residual stream"))

    def stored_format(self) -> None:
        """quantization_config named as the format it says (parsed in full by the released-formats work), with the
        tensors holding its packed codes and scales: the runtime keeps no packed format yet."""
        quant = self.manifest.config.get("quantization_config")
        if not isinstance(quant, dict):
            return
        formats = {str(g.get("format")) for g in (quant.get("config_groups") or {}).values()
                   if isinstance(g, dict) and g.get("format")} or {str(quant.get("format") or quant.get("fmt"))}
        # the tensors as released: the manifest's logical view hides codes and scales under the weights' names
        released = self.manifest.released or self.manifest.tensors
        packed = sorted({INDEX_RE.sub(".N.", n) for n in released if n.endswith(("_packed", "_scale", "_blocks"))})
        self.unrecognized.append(Unrecognized(
            source="config.json:quantization_config", item=f"stored format {', '.join(sorted(formats))}",
            detail=f"quantization_config (quant_method {quant.get('quant_method')!r}) stores weights packed: "
                   f"{len(packed)} tensor pattern(s) of codes and scales ({', '.join(packed[:6])}); the runtime does "
                   "not keep a packed format yet"))

    def num_layers(self) -> int:
        keys = ("num_hidden_layers", "num_layers", "n_layer")
        # without a count key, transformers' model of the release (where it knows the family) is the oracle
        counted = None if self.cfg.has(*keys) else transformers_layer_count(self.manifest)
        return counted or self.cfg.positive_int(*keys)

    def logit_softcap(self) -> float | None:
        """transformers' name for a tanh cap on the logits after the LM head; absent or null: none."""
        if not self.cfg.has("final_logit_softcapping"):
            return None
        cap = self.cfg.number("final_logit_softcapping")
        if cap <= 0:
            raise NotRecognized(self.cfg._dotted("final_logit_softcapping"), f"recognized for caps > 0, got {cap!r}")
        return cap

    def _architecture(self) -> str:
        archs = self.manifest.config.get("architectures") or ["unknown"]
        return str(archs[0])

    def _component(self, index: int, what: str, build, *args):
        """The component as recognized, or OwnModule when a recognition rule does not hold for it."""
        try:
            return build(*args)
        except NotRecognized as gap:
            self.unrecognized.append(Unrecognized(source=f"config.json:{gap.key}", item=gap.key,
                                                  detail=f"{what}: {gap.message}"))
            return OwnModule(reason=f"layer {index} {what}: {gap}")

    # ---- layer pattern
    def layer_kinds(self, num_layers: int) -> list[str]:
        key = "layer_types"
        types = self.cfg.get(key, default=None)
        if types is None and self.cfg.has("attn_type_list"):
            key = "attn_type_list"
            types = [ATTN_TYPE_FLAGS.get(t, f"attn_type_list={t}") for t in self.cfg.get(key)]
        if types is None:
            return self._kinds_without_types(num_layers)
        self._check_per_layer(key, types, num_layers)
        # a layer type we do not know is judged per layer (attention below), never refused
        return [LAYER_KIND_ALIASES.get(t, f"unknown:{t}") for t in types]

    def _kinds_without_types(self, num_layers: int) -> list[str]:
        """No layer_types: linear_attn_config's 1-based `kda_layers` (Kimi's way) say which layers are linear;
        else a layer holding a linear attention's own tensors (decay A_log, dt_bias, short convs) is linear."""
        lin = self.cfg.get("linear_attn_config", default=None)
        listed = lin.get("kda_layers") if isinstance(lin, dict) else None
        if isinstance(listed, list) and all(type(i) is int for i in listed):
            return ["linear" if i + 1 in listed else "full" for i in range(num_layers)]
        return ["linear" if self._layer_has(i, LINEAR_ATTENTION_TENSORS) else "full" for i in range(num_layers)]

    def _check_per_layer(self, key: str, values, num_layers: int) -> None:
        """A per-layer list the file sizes otherwise than its layer count contradicts the file itself
        (config_checks compares it with the count key; here with the count recognition settled on)."""
        if not isinstance(values, list) or len(values) != num_layers:
            raise BadInput(self.cfg.path, self.cfg._dotted(key), f"expected a list of {num_layers} entries, one "
                           f"per layer, got {values!r:.80}")

    # ---- attention
    def attention(self, index: int, kind: str):
        if kind.startswith("unknown:"):
            raise NotRecognized(self.cfg._dotted("layer_types"), f"layer type {kind.removeprefix('unknown:')!r}")
        if kind == "linear":
            return self.linear_attention(index)
        if self.cfg.has("kv_lora_rank") and self._layer_has(index, r"(kv_a_proj_with_mqa)"):
            return self.mla(index, sparse=(kind == "sparse"))
        if kind == "sparse":
            raise NotRecognized(self.cfg._dotted("layer_types"), "sparse attention without MLA weights")
        return self.softmax(index, window=(kind == "sliding"))

    def _layer_has(self, index: int, pattern: str) -> bool:
        rx = re.compile(pattern)
        return any(rx.search(s) for s in self.suffixes.get(index, ()))

    def _shape(self, index: int, suffix_pattern: str):
        rx = re.compile(suffix_pattern)
        prefix = f"{self.naming.prefix}layers.{index}."
        for s in self.suffixes.get(index, ()):
            if rx.search(s):
                info = self.manifest.tensors.get(prefix + s)
                return info.shape if info else None
        return None

    def head_dim(self) -> int:
        heads = self.cfg.positive_int("num_attention_heads", "n_head")
        return self.cfg.positive_int("head_dim", default=None) or self.cfg.positive_int("hidden_size") // heads

    def rope(self, rotary_base_dim: int, interleaved: bool = False) -> RopeSpec:
        params = dict(self.cfg.get("rope_parameters", default=None) or {})
        legacy = self.cfg.get("rope_scaling", default=None) or {}
        theta = params.pop("rope_theta", None) or self.cfg.number("rope_theta", default=10000.0)
        factor = params.pop("partial_rotary_factor", None) or self.cfg.number("partial_rotary_factor", default=1.0)
        mrope_section = params.pop("mrope_section", None)
        mrope_interleaved = bool(params.pop("mrope_interleaved", False))
        scaling = {**legacy, **params}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        if mrope_section is None and self.manifest.vision_config is not None and transformers_knows(self.family):
            # the vision path's positions have three axes: the split the model code applies by default
            mrope_section, mrope_interleaved = probed_mrope(self.manifest, int(rotary_base_dim * factor) // 2,
                                                            self.cfg._dotted("rope_parameters"))
        return RopeSpec(theta=float(theta), rotary_dim=int(rotary_base_dim * factor), interleaved=interleaved,
                        scaling=scaling, mrope_section=mrope_section, mrope_interleaved=mrope_interleaved)

    def softmax(self, index: int, window: bool) -> SoftmaxAttention:
        heads = self.cfg.positive_int("num_attention_heads", "n_head")
        kv_heads = self.cfg.positive_int("num_key_value_heads", default=heads)
        head_dim = self.head_dim()
        # biases and qk-norm are read off the weights, which are the facts
        self.cfg.mark_used("attention_bias", "use_bias", "use_qk_norm")
        q_shape = self._shape(index, r"\.q_proj\.weight$")
        gated = q_shape[0] == 2 * heads * head_dim if q_shape else self.family in GATED_ATTENTION_FAMILIES
        qn_shape = self._shape(index, r"\.q_norm\.weight$")
        qk_norm = "none"
        if self._layer_has(index, r"\.q_norm\.weight$"):
            qk_norm = "full" if (qn_shape and qn_shape[0] == heads * head_dim and heads > 1) else "head"
        sliding = self.cfg.positive_int("sliding_window", default=None) if window else None
        if window and sliding is None:
            raise NotRecognized(self.cfg._dotted("sliding_window"), "sliding layers without a window size")
        return SoftmaxAttention(
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rope=self.rope(head_dim, interleaved=self.family in INTERLEAVED_ROPE_FAMILIES),
            qkv_bias=self._layer_has(index, r"\.q_proj\.bias$"), o_bias=self._layer_has(index, r"\.o_proj\.bias$"),
            qk_norm=qk_norm, sliding_window=sliding, sinks=self._layer_has(index, r"\.sinks$"), output_gate=gated)

    def mla(self, index: int, sparse: bool) -> MLAAttention:
        rope_dim = self.cfg.positive_int("qk_rope_head_dim")
        indexer = None
        if sparse:
            indexer = DSAIndexer(num_heads=self.cfg.positive_int("index_n_heads"),
                                 head_dim=self.cfg.positive_int("index_head_dim"),
                                 topk=self.cfg.positive_int("index_topk"))
        qk = self.cfg.positive_int("qk_head_dim", default=None)
        if qk is not None and qk != self.cfg.positive_int("qk_nope_head_dim") + rope_dim:
            raise NotRecognized(self.cfg._dotted("qk_head_dim"), f"recognized as qk_nope_head_dim + qk_rope_head_dim, got {qk}")
        # MLA has one latent kv; head_dim / kv heads keys are the unabsorbed view's bookkeeping
        self.cfg.mark_used("head_dim", "num_key_value_heads", "attention_bias", "mlp_bias")
        # mla_use_nope: the key Kimi's releases say it with (the rope part of the key is used unrotated)
        nope = self.family in NOPE_MLA_FAMILIES or bool(self.cfg.get("mla_use_nope", default=False))
        # without the key: the family's known layout, else what transformers' own rotary function does
        known = self.family in ("deepseek_v3", "deepseek_v32") or rope_pairs_interleaved(self.manifest)
        interleaved = bool(self.cfg.get("rope_interleave", default=known))
        mla = MLAAttention(
            num_heads=self.cfg.positive_int("num_attention_heads"),
            q_lora_rank=self.cfg.positive_int("q_lora_rank", default=None),
            kv_lora_rank=self.cfg.positive_int("kv_lora_rank"),
            qk_nope_head_dim=self.cfg.positive_int("qk_nope_head_dim"), qk_rope_head_dim=rope_dim,
            v_head_dim=self.cfg.positive_int("v_head_dim"),
            rope=None if nope else self.rope(rope_dim, interleaved=interleaved), indexer=indexer)
        # read after the widths, so that they count as understood: only the gate is not
        if self.cfg.get("mla_use_output_gate", default=False) or self._layer_has(index, r"^[a-z_]+\.g_proj\.weight$"):
            raise NotRecognized(self.cfg._dotted("mla_use_output_gate"), "MLA with a sigmoid output gate (g_proj: the "
                                "attention output times sigmoid(g_proj(x)) before o_proj); the mla op has no output gate")
        return mla

    def linear_attention(self, index: int):
        lin = ConfigView(self.cfg.get("linear_attn_config", default=None) or {}, self.cfg.path,
                         self.cfg._dotted("linear_attn_config"))
        kernel = lin.get("kernel", default=None)
        if kernel == "kda" or lin.has("kda_layers") or self.family == "kimi_linear" or self._layer_has(index, r"f_a_proj"):
            return self._kda(index, lin)
        if self.family == "minimax" or self._layer_has(index, r"\.slope_rate$|\.qkv_proj\.weight$"):
            heads = self.cfg.positive_int("num_attention_heads")
            return LightningAttention(num_heads=heads, head_dim=self.head_dim(),
                                      block_size=self.cfg.positive_int("block_size", default=256))
        if self.cfg.has("linear_num_value_heads") or self._layer_has(index, r"in_proj_qkv"):
            return self._gated_delta(index)
        raise NotRecognized(self.cfg._dotted("layer_types"), "linear attention of a kind not recognized from keys or weights")

    def _kda(self, index: int, lin: ConfigView) -> KDAAttention:
        heads = lin.positive_int("num_heads", default=None) or self.cfg.positive_int("linear_num_heads", "num_attention_heads")
        head_dim = lin.positive_int("head_dim", default=None) or self.cfg.positive_int("linear_head_dim", "head_dim")
        conv = lin.positive_int("short_conv_kernel_size", default=None) or self.cfg.positive_int("linear_conv_kernel_dim", default=4)
        lin.mark_used("kda_layers", "full_attn_layers")
        self._kda_variant(lin)
        self._report_unused(lin)
        return KDAAttention(num_heads=heads, head_dim=head_dim, conv_kernel_size=conv,
                            separate_convs=self._layer_has(index, r"\.q_conv1d\.weight$"))

    def _kda_variant(self, lin: ConfigView) -> None:
        """Kimi K3's KDA computes its decay and output gate otherwise than the kda op: named, not guessed."""
        features = []
        bound = lin.get("gate_lower_bound", default=None)
        if bound is not None:
            features.append(f"a lower-bounded (safe) gate, gate_lower_bound={bound!r}: log-decay = gate_lower_bound * "
                            "sigmoid(exp(A_log) * (f + dt_bias)), not the kda op's -exp(A_log) * softplus(f + dt_bias)")
        if lin.get("use_full_rank_gate", default=False):
            features.append("a full-rank output gate (use_full_rank_gate: g_proj), not the low-rank g_a/g_b pair")
        if features:
            raise NotRecognized(lin._dotted("gate_lower_bound" if bound is not None else "use_full_rank_gate"),
                                "KDA with " + "; and ".join(features))

    def _gated_delta(self, index: int) -> GatedDeltaAttention:
        fused = "qkvz_ba" if self._layer_has(index, r"in_proj_qkvz") else "qkv_z_b_a"
        return GatedDeltaAttention(
            num_k_heads=self.cfg.positive_int("linear_num_key_heads"),
            num_v_heads=self.cfg.positive_int("linear_num_value_heads"),
            head_k_dim=self.cfg.positive_int("linear_key_head_dim"),
            head_v_dim=self.cfg.positive_int("linear_value_head_dim"),
            conv_kernel_size=self.cfg.positive_int("linear_conv_kernel_dim", default=4), fused_projections=fused)

    def _report_unused(self, view: ConfigView) -> None:
        for key in view.unused():
            self.unrecognized.append(Unrecognized(source=f"config.json:{key}", item=key, detail="linear attention key"))

    # ---- FFN
    def moe_layer_flags(self, num_layers: int) -> list[bool | str]:
        """Per layer: MoE or not, or "unknown:TYPE" for an mlp_layer_types entry not recognized."""
        if self.cfg.get("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", default=0) in (0, None):
            return [False] * num_layers
        mlp_types = self.cfg.get("mlp_layer_types", default=None)
        if mlp_types is not None:
            self.cfg.mark_used("first_k_dense_replace")
            self._check_per_layer("mlp_layer_types", mlp_types, num_layers)
            # an FFN type we do not know is judged per layer (ffn below), never refused
            return [MLP_LAYER_KINDS.get(t, f"unknown:{t}") for t in mlp_types]
        if self.cfg.has("moe_layer_start_index"):
            start = self.cfg.positive_int("moe_layer_start_index", allow_zero=True)
            end = self.cfg.positive_int("moe_layer_end_index", default=num_layers - 1, allow_zero=True)
            every = self.cfg.positive_int("moe_layer_interval", default=1)
            return [start <= i <= end and (i + 1) % every == 0 for i in range(num_layers)]
        first_dense = self.cfg.positive_int("first_k_dense_replace", default=0, allow_zero=True)
        step = self.cfg.positive_int("decoder_sparse_step", "moe_layer_freq", default=1)
        dense_only = set(self.cfg.get("mlp_only_layers", default=[]) or [])
        return [i >= first_dense and (i + 1) % step == 0 and i not in dense_only for i in range(num_layers)]

    def ffn(self, index: int, is_moe: bool | str):
        if isinstance(is_moe, str):
            raise NotRecognized(self.cfg._dotted("mlp_layer_types"), f"FFN type {is_moe.removeprefix('unknown:')!r}")
        if not is_moe:
            width = self.cfg.positive_int("intermediate_size", "ffn_hidden_size")
            return DenseFFN(intermediate_size=width, activation=self.activation(),
                            bias=self._layer_has(index, r"mlp\.up_proj\.bias$"))
        return self.moe(index)

    def activation(self) -> str:
        """hidden_act, with its parameters (`activation_<name>_*` keys: the gap report names them beside it); the
        registry's predicate judges whether the FFN ops compute it."""
        name, params = declared_activation(self.cfg.data)
        self.cfg.get("hidden_act", default=None)
        self.cfg.mark_used(*params)
        return name

    def config_source(self, key: str) -> str:
        return f"config.json:{self.cfg._dotted(key)}"

    def _latent_moe(self, index: int) -> None:
        """Experts that run in a latent space narrower than the hidden width (a shared down-projection before them,
        a norm and an up-projection after): the moe op runs experts at the hidden width."""
        latent = self.cfg.positive_int("routed_expert_hidden_size", default=None)
        tensors = self._layer_has(index, r"routed_expert_(down|up)_proj")
        if latent is None and not tensors:
            return
        norm = self.cfg.get("latent_moe_use_norm", default=None)
        raise NotRecognized(self.cfg._dotted("routed_expert_hidden_size"),
                            f"latent MoE: routed experts run in a latent space of width {latent} (routed_expert_hidden_size:"
                            f" a shared down-projection routed_expert_down_proj before them, latent RMSNorm "
                            f"latent_moe_use_norm={norm!r}, up-projection routed_expert_up_proj after); shared experts at "
                            "full width; the moe op runs experts at the hidden width")

    def moe(self, index: int) -> MoEFFN:
        experts = self.cfg.positive_int("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
        top_k = self.cfg.positive_int("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk")
        width = self.cfg.positive_int("moe_intermediate_size", "expert_intermediate_size", default=None) \
            or self.cfg.positive_int("intermediate_size")
        shared = self.cfg.positive_int("n_shared_experts", "num_shared_experts", "moe_num_shared_experts",
                                       default=0, allow_zero=True)
        shared_width = self.cfg.positive_int("shared_expert_intermediate_size", default=0, allow_zero=True)
        has_shared = self._layer_has(index, r"shared_experts?\.up_proj")
        if has_shared and not shared:
            shared = 1
        if shared and not shared_width:
            shared_width = width * shared
        limit = self.cfg.get("swiglu_limit", default=None)
        moe = MoEFFN(
            num_experts=experts, top_k=top_k, expert_intermediate_size=width, router=self.router(index),
            num_shared_experts=shared if has_shared else 0, shared_intermediate_size=shared_width if has_shared else 0,
            shared_expert_gate=self._layer_has(index, r"shared_expert_gate\.weight$"),
            activation=self.activation(),
            expert_bias=self._layer_has(index, r"experts\.(gate_up_proj_bias|N\.up_proj\.bias)"),
            swiglu_limit=float(limit) if limit is not None else None,
            swiglu_alpha=float(self.cfg.get("swiglu_alpha", default=1.702)) if limit is not None else None,
            interleaved_gate_up=limit is not None and self.naming.expert_style == "fused_gate_up")
        # read after the widths and the router, so that they count as understood: only the latent space is not
        self._latent_moe(index)
        return moe

    def router(self, index: int) -> RouterSpec:
        scoring = self.cfg.get("scoring_func", "moe_router_activation_func", default=None)
        correction = self._layer_has(index, r"e_score_correction_bias$")
        if scoring is None:
            # DeepSeek-style releases (bias-corrected, group-limited) score with sigmoid without saying so
            sigmoid_style = correction and (self.cfg.has("n_group", "num_expert_group", "routed_scaling_factor"))
            scoring = "sigmoid" if sigmoid_style else "softmax"
        # DeepSeek's topk_method only names the routing the other keys and weights already describe;
        # any other value is left unread, so it is reported as unrecognized
        if self.cfg.get("topk_method", default=None) not in KNOWN_TOPK_METHODS:
            self.cfg.used.discard("topk_method")
        # use_grouped_topk only switches on what num_expert_group / topk_group say
        self.cfg.mark_used("use_grouped_topk")
        topk_first = self.family in ("mixtral", "minimax", "gpt_oss")
        norm_default = topk_first or self.family in ("qwen3_5_moe", "qwen3_5_moe_text") or self.cfg.has("moe_norm_min")
        norm = bool(self.cfg.get("norm_topk_prob", "moe_renormalize", default=norm_default))
        return RouterSpec(
            scoring=scoring, norm_topk_prob=norm,
            routed_scaling_factor=self.cfg.number("routed_scaling_factor", default=1.0),
            correction_bias=correction,
            num_groups=self.cfg.positive_int("n_group", "num_expert_group", default=1),
            topk_groups=self.cfg.positive_int("topk_group", default=1),
            topk_before_softmax=topk_first, bias=self._layer_has(index, r"router\.bias$"),
            norm_min=self.cfg.number("moe_norm_min", default=0.0) or None,
            aux_loss_coef=self.cfg.number("router_aux_loss_coef", default=0.0) or None)

    def residual(self, kind: str) -> ResidualSpec:
        attn = "linear_attn" if kind == "linear" else "full_attn"
        factors = dict(attn_alpha=self.cfg.number(f"{attn}_alpha_factor", default=1.0),
                       attn_beta=self.cfg.number(f"{attn}_beta_factor", default=1.0),
                       ffn_alpha=self.cfg.number("mlp_alpha_factor", default=1.0),
                       ffn_beta=self.cfg.number("mlp_beta_factor", default=1.0))
        return ResidualSpec(skip_from_normed=self.family in NORMED_SKIP_FAMILIES, **factors)

    def norm(self) -> NormSpec:
        eps = self.cfg.number("rms_norm_eps", "layer_norm_epsilon", "norm_eps", default=1e-6)
        return NormSpec(kind="rms_1p" if self.family in ONE_PLUS_W_NORM_FAMILIES else "rms", eps=eps)

    # ---- what was not understood
    def collect_unrecognized(self) -> None:
        if self.manifest.quantization is not None:
            # read by the manifest (onboard/release/quantization.py), wherever the release put it
            self.top.mark_used("quantization_config")
            self.cfg.mark_used("quantization_config")
        for view in {id(v): v for v in (self.cfg, self.top)}.values():
            for key in view.unused():
                if key.startswith("vision_config") or key == "vision_config":
                    continue
                self.unrecognized.append(Unrecognized(source=f"config.json:{key}", item=key,
                                                      detail="config key not used by recognition"))
        auto_map = self.manifest.config.get("auto_map") or {}
        for role, target in auto_map.items():
            self.unrecognized.append(Unrecognized(source="config.json:auto_map", item=f"{role}={target}",
                                                  detail="custom module class; recognized from keys and weight names instead"))


def recognize(manifest: Manifest) -> ModelSpec:
    """The normalized architecture: config rules first, then what the weights say (recognize_weights)."""
    from onboard.recognize import weights as recognize_weights
    from onboard.recognize.stored import with_stored

    return with_stored(recognize_weights.apply(Recognizer(manifest).run(), manifest), manifest)
