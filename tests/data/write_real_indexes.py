"""Write the weight indexes of two real quantized releases beside the seed example: their config.json as released
and model.safetensors.index.json with every tensor name the release has (no tensor data, like the seed example).

    python tests/data/write_real_indexes.py      # rewrites tests/data/deepseek-v3-fp8 and tests/data/gpt-oss-120b-mxfp4
    xz -dk tests/data/deepseek-v3-fp8/model.safetensors.index.json.xz   # a release folder `onboard plan` reads

The tensor list is transformers' model of the config (its bf16 names and shapes, on the meta device) stored as each
release stores it: DeepSeek-V3 (deepseek-ai/DeepSeek-V3) every projection of the layers float8_e4m3fn with a float32
`weight_scale_inv` per 128x128 block, its router, norms, embedding and head bf16, its correction bias fp32, plus the
multi-token-prediction layer 61 it ships; gpt-oss-120b (openai/gpt-oss-120b) its experts as MXFP4 `_blocks` /
`_scales`, everything else bf16. Shard names follow each release's own numbering; total_size is the sum of the
stored bytes.
"""
from __future__ import annotations

import json
import lzma
import math
from pathlib import Path

HERE = Path(__file__).resolve().parent
BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "num_local_experts": 128, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}


def bf16_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """Released name -> shape of transformers' model of `config` (a bf16 release of it), built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    settings = {k: v for k, v in config.items() if k not in ("auto_map", "quantization_config")}
    hf_config = AutoConfig.for_model(**settings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False)
    state = revert_weight_conversion(model, model.state_dict())
    return {name: tuple(t.shape) for name, t in state.items()}


def deepseek_v3() -> dict[str, tuple[str, tuple[int, ...]]]:
    tensors = bf16_tensors(DEEPSEEK_V3)
    # the multi-token-prediction layer the release ships after its 61 layers (transformers does not load it)
    mtp = {k.replace("layers.60.", "layers.61."): s for k, s in tensors.items() if ".layers.60." in k}
    d, v = DEEPSEEK_V3["hidden_size"], DEEPSEEK_V3["vocab_size"]
    mtp |= {"model.layers.61.embed_tokens.weight": (v, d), "model.layers.61.enorm.weight": (d,),
            "model.layers.61.hnorm.weight": (d,), "model.layers.61.eh_proj.weight": (d, 2 * d),
            "model.layers.61.shared_head.norm.weight": (d,), "model.layers.61.shared_head.head.weight": (v, d)}
    out = {}
    for name, shape in {**tensors, **mtp}.items():
        quantized = (".layers." in name and name.endswith("proj.weight") and len(shape) == 2)
        if quantized:
            out[name] = ("F8_E4M3", shape)
            out[name[: -len(".weight")] + ".weight_scale_inv"] = ("F32", tuple(math.ceil(n / 128) for n in shape))
        else:
            out[name] = ("F32" if name.endswith("e_score_correction_bias") else "BF16", shape)
    return out


def gpt_oss_120b() -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for name, shape in bf16_tensors(GPT_OSS_120B).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, cols, rows = shape  # the bf16 experts are [E, in, out]; the blocks hold [E, out, in]
            out[name + "_blocks"] = ("U8", (experts, rows, cols // 32, 16))
            out[name + "_scales"] = ("U8", (experts, rows, cols // 32))
        else:
            out[name] = ("BF16", shape)
    return out


def write(folder: Path, config: dict, tensors: dict, num_shards: int, shard_name) -> None:
    """config.json and the index: tensors in order over the release's number of shards."""
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {name: math.prod(shape) * BYTES[dtype] for name, (dtype, shape) in tensors.items()}
    shard_bytes, start, placed = sum(sizes.values()) / num_shards, 0, {}
    for name, size in sizes.items():
        placed[name], start = min(num_shards - 1, int(start // shard_bytes)), start + size
    index = {"metadata": {"total_size": sum(sizes.values())},
             "weight_map": {name: shard_name(i, num_shards) for name, i in placed.items()}}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # compressed like the seed example's copy (tests/conftest.py decompresses it): the DeepSeek-V3 index is 9 MB
    with lzma.open(folder / "model.safetensors.index.json.xz", "wt", preset=9) as f:
        f.write(json.dumps(index, indent=1) + "\n")


def main() -> None:
    write(HERE / "deepseek-v3-fp8", DEEPSEEK_V3, deepseek_v3(), 163,
          lambda i, n: f"model-{i + 1:05d}-of-{n:06d}.safetensors")
    write(HERE / "gpt-oss-120b-mxfp4", GPT_OSS_120B, gpt_oss_120b(), 15,
          lambda i, n: f"model-{i:05d}-of-{n - 1:05d}.safetensors")


if __name__ == "__main__":
    main()
