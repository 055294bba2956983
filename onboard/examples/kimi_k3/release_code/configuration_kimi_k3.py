"""Configuration of the tiny Kimi K3-shaped example release (its own code, shipped beside the weights).

The keys are the ones Kimi K3's config.json is publicly described with: a multimodal wrapper
(`model_type: kimi_k3`) holding `text_config` (`model_type: kimi_linear`) and `vision_config` (`vt_*` keys).
Values are tiny; the release writer (onboard/examples/kimi_k3/writer.py) sets them.
"""
from transformers import PretrainedConfig


class KimiK3TextConfig(PretrainedConfig):
    model_type = "kimi_linear"

    def __init__(self, vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                 num_attention_heads=4, num_key_value_heads=4, hidden_act="situ", activation_situ_beta=4.0,
                 activation_situ_linear_beta=25.0, rms_norm_eps=1e-5, linear_attn_config=None, q_lora_rank=32,
                 kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True,
                 mla_use_output_gate=True, num_experts=8, num_experts_per_token=2, num_shared_experts=2,
                 moe_intermediate_size=32, routed_expert_hidden_size=32, latent_moe_use_norm=True,
                 moe_router_activation_func="sigmoid", topk_method="noaux_tc", use_grouped_topk=True,
                 num_expert_group=1, topk_group=1, moe_renormalize=True, routed_scaling_factor=2.5,
                 first_k_dense_replace=1, attn_res_block_size=4, tie_word_embeddings=False, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.hidden_act, self.activation_situ_beta = hidden_act, activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.rms_norm_eps = rms_norm_eps
        self.linear_attn_config = linear_attn_config or {}
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.mla_use_nope, self.mla_use_output_gate = mla_use_nope, mla_use_output_gate
        self.num_experts, self.num_experts_per_token = num_experts, num_experts_per_token
        self.num_shared_experts, self.moe_intermediate_size = num_shared_experts, moe_intermediate_size
        self.routed_expert_hidden_size, self.latent_moe_use_norm = routed_expert_hidden_size, latent_moe_use_norm
        self.moe_router_activation_func, self.topk_method = moe_router_activation_func, topk_method
        self.use_grouped_topk, self.num_expert_group, self.topk_group = use_grouped_topk, num_expert_group, topk_group
        self.moe_renormalize, self.routed_scaling_factor = moe_renormalize, routed_scaling_factor
        self.first_k_dense_replace, self.attn_res_block_size = first_k_dense_replace, attn_res_block_size
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def is_kda_layer(self, index: int) -> bool:
        """Layer `index` (0-based) is KDA: linear_attn_config's layer lists are 1-based."""
        return index + 1 in self.linear_attn_config.get("kda_layers", [])


class KimiK3VisionConfig(PretrainedConfig):
    model_type = "moonvit3d"

    def __init__(self, patch_size=4, vt_num_hidden_layers=2, vt_hidden_size=32, vt_intermediate_size=64,
                 vt_num_attention_heads=2, mm_hidden_size=32, text_hidden_size=64, mm_projector_type="patchmergerv2",
                 merge_type="sd2_tpool", merge_kernel_size=(2, 2), pos_emb_type="divided_fixed",
                 init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=4, **kwargs):
        self.patch_size, self.vt_num_hidden_layers, self.vt_hidden_size = patch_size, vt_num_hidden_layers, vt_hidden_size
        self.vt_intermediate_size, self.vt_num_attention_heads = vt_intermediate_size, vt_num_attention_heads
        self.mm_hidden_size, self.text_hidden_size = mm_hidden_size, text_hidden_size
        self.mm_projector_type, self.merge_type, self.merge_kernel_size = mm_projector_type, merge_type, list(merge_kernel_size)
        self.pos_emb_type, self.init_pos_emb_height = pos_emb_type, init_pos_emb_height
        self.init_pos_emb_width, self.init_pos_emb_time = init_pos_emb_width, init_pos_emb_time
        super().__init__(**kwargs)


class KimiK3Config(PretrainedConfig):
    model_type = "kimi_k3"
    sub_configs = {"text_config": KimiK3TextConfig, "vision_config": KimiK3VisionConfig}

    def __init__(self, text_config=None, vision_config=None, media_placeholder_token_id=250, **kwargs):
        self.text_config = text_config if isinstance(text_config, KimiK3TextConfig) else KimiK3TextConfig(**(text_config or {}))
        self.vision_config = (vision_config if isinstance(vision_config, KimiK3VisionConfig)
                              else KimiK3VisionConfig(**(vision_config or {})))
        self.media_placeholder_token_id = media_placeholder_token_id
        # the routed experts' stored format: the text model reads it (modeling_kimi_k3.packed_experts)
        if kwargs.get("quantization_config") is not None:
            self.text_config.quantization_config = kwargs["quantization_config"]
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    def get_text_config(self, *args, **kwargs):
        return self.text_config
