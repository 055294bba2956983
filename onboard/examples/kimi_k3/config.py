"""The tiny example's config.json values: Kimi K3's keys at toy widths.

Five layers show every layer kind: KDA on 1-3, gated MLA on 4 (every fourth) and 5 (the last), as K3 lists them
(1-based) in linear_attn_config; layer 1 is dense (first_k_dense_replace), the rest latent MoE. Widths keep the
MXFP4 group (32) dividing every routed expert's input width.
"""
from __future__ import annotations

NUM_LAYERS = 5
KDA_LAYERS = [1, 2, 3]
FULL_ATTN_LAYERS = [4, 5]

TEXT_CONFIG = dict(
    model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], vocab_size=256, hidden_size=64,
    intermediate_size=96, num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=4,
    hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0, rms_norm_eps=1e-5,
    linear_attn_config=dict(head_dim=16, num_heads=4, short_conv_kernel_size=4, use_full_rank_gate=True,
                            gate_lower_bound=-5.0, kda_layers=KDA_LAYERS, full_attn_layers=FULL_ATTN_LAYERS),
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True,
    mla_use_output_gate=True, num_experts=8, num_experts_per_token=2, num_shared_experts=2, moe_intermediate_size=32,
    routed_expert_hidden_size=32, latent_moe_use_norm=True, moe_router_activation_func="sigmoid",
    topk_method="noaux_tc", use_grouped_topk=True, num_expert_group=1, topk_group=1, moe_renormalize=True,
    routed_scaling_factor=2.5, first_k_dense_replace=1, attn_res_block_size=4, tie_word_embeddings=False,
    max_position_embeddings=1048576, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
VISION_CONFIG = dict(
    model_type="moonvit3d", patch_size=4, vt_num_hidden_layers=2, vt_hidden_size=32, vt_intermediate_size=64,
    vt_num_attention_heads=2, mm_hidden_size=32, text_hidden_size=64, mm_projector_type="patchmergerv2",
    merge_type="sd2_tpool", merge_kernel_size=[2, 2], pos_emb_type="divided_fixed", init_pos_emb_height=8,
    init_pos_emb_width=8, init_pos_emb_time=4,
)
# image features replace these tokens' embeddings; above the example tokenizer's 240 ids, inside the vocabulary
MEDIA_PLACEHOLDER_TOKEN_ID = 250
# What transformers 4 wrote into every nested config's to_dict (the sampling defaults of that era): a release
# saved then carries them in text_config, beside the architecture keys.
GENERATION_DEFAULTS = dict(
    max_length=20, min_length=0, do_sample=False, early_stopping=False, num_beams=1, num_beam_groups=1,
    diversity_penalty=0.0, temperature=1.0, top_k=50, top_p=1.0, typical_p=1.0, repetition_penalty=1.0,
    length_penalty=1.0, no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0, bad_words_ids=None,
    num_return_sequences=1, output_scores=False, return_dict_in_generate=False, forced_bos_token_id=None,
    forced_eos_token_id=None, remove_invalid_values=False, exponential_decay_length_penalty=None,
    suppress_tokens=None, begin_suppress_tokens=None,
)
# compressed-tensors' form of the routed experts' MXFP4, as Kimi K3's config.json carries it: 4-bit floats in
# groups of 32 with uint8 (E8M0) scales, packed two per byte; everything but the routed experts stays bf16
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"], "format": "mxfp4-pack-quantized",
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                    "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": None, "observer": "minmax"},
        "input_activations": None, "output_activations": None}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*", "re:vision_tower.*",
               "re:mm_projector.*"],
}
AUTO_MAP = {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"}


def config_kwargs(weights: str = "bf16") -> dict:
    """KimiK3Config's arguments (the generation defaults are added to config.json after saving)."""
    quant = {"quantization_config": QUANTIZATION_CONFIG} if weights == "mxfp4" else {}
    return dict(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG,
                media_placeholder_token_id=MEDIA_PLACEHOLDER_TOKEN_ID, **quant)
