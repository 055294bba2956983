"""The tensors a release of a given ModelSpec must contain, with their shapes.

Used by the weight check of the gap report and by the weight map of the package: one place knows
how each attention and FFN kind lays out its released weights.
"""
from __future__ import annotations

from onboard.release.naming import head_name
from runtime.spec import (DenseFFN, GatedDeltaAttention, KDAAttention, LightningAttention, MLAAttention, ModelSpec,
                          MoEFFN, OwnModule, SoftmaxAttention, own_tensors)

Shapes = dict[str, tuple[int, ...]]


def expected_tensors(spec: ModelSpec) -> Shapes:
    """Released tensor name -> shape for the text model (vision tensors are counted, not listed)."""
    n, d = spec.naming, spec.hidden_size
    out: Shapes = {f"{n.prefix}{n.embedding}.weight": (spec.vocab_size, d), f"{n.prefix}{n.final_norm}.weight": (d,)}
    if not spec.tie_word_embeddings:
        out[head_name(n)] = (spec.vocab_size, d)
    for layer in spec.layers:
        out |= own_module_tensors(layer)
        if layer.own_layer:
            continue
        base = f"{n.prefix}layers.{layer.index}."
        out[base + "input_layernorm.weight"] = (d,)
        out[base + "post_attention_layernorm.weight"] = (d,)
        attn_module = n.softmax_module if layer.attention.kind in ("softmax", "mla") else n.linear_module
        for name, shape in attention_tensors(layer.attention, d, n).items():
            out[f"{base}{attn_module}.{name}"] = shape
        for name, shape in ffn_tensors(layer.ffn, d, n).items():
            out[f"{base}{n.ffn_module}.{name}"] = shape
    return out


def own_module_tensors(layer) -> Shapes:
    """Released name -> shape of the layer's components that run as their own modules."""
    return {name: tuple(shape) for part in (layer.attention, layer.ffn) for name, shape in own_tensors(part).items()}


def buffer_names(spec: ModelSpec) -> set[str]:
    """Tensors a release stores that are derived buffers rather than trained parameters."""
    names = set()
    for layer in spec.layers:
        if layer.attention.kind == "lightning":
            base = f"{spec.naming.prefix}layers.{layer.index}.{spec.naming.linear_module}."
            names |= {base + b for b in ("slope_rate", "query_decay", "key_decay", "diagonal_decay")}
    return names


def attention_tensors(a, d: int, naming) -> Shapes:
    if isinstance(a, SoftmaxAttention):
        return _softmax(a, d)
    if isinstance(a, MLAAttention):
        return _mla(a, d)
    if isinstance(a, GatedDeltaAttention):
        return _gated_delta(a, d)
    if isinstance(a, KDAAttention):
        return _kda(a, d, naming.kda_gate_prefix)
    if isinstance(a, LightningAttention):
        return _lightning(a, d)
    if isinstance(a, OwnModule):
        return {}  # listed under their released names by own_module_tensors
    raise TypeError(a)


def _softmax(a: SoftmaxAttention, d: int) -> Shapes:
    q_out = a.num_heads * a.head_dim * (2 if a.output_gate else 1)
    kv_out = a.num_kv_heads * a.head_dim
    out = {"q_proj.weight": (q_out, d), "k_proj.weight": (kv_out, d), "v_proj.weight": (kv_out, d),
           "o_proj.weight": (d, a.num_heads * a.head_dim)}
    if a.qkv_bias:
        out |= {"q_proj.bias": (q_out,), "k_proj.bias": (kv_out,), "v_proj.bias": (kv_out,)}
    if a.o_bias:
        out["o_proj.bias"] = (d,)
    if a.qk_norm == "head":
        out |= {"q_norm.weight": (a.head_dim,), "k_norm.weight": (a.head_dim,)}
    elif a.qk_norm == "full":
        out |= {"q_norm.weight": (a.num_heads * a.head_dim,), "k_norm.weight": (kv_out,)}
    if a.sinks:
        out["sinks"] = (a.num_heads,)
    return out


def _mla(a: MLAAttention, d: int) -> Shapes:
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    out: Shapes = {}
    if a.q_lora_rank:
        out |= {"q_a_proj.weight": (a.q_lora_rank, d), "q_a_layernorm.weight": (a.q_lora_rank,),
                "q_b_proj.weight": (a.num_heads * qk, a.q_lora_rank)}
    else:
        out["q_proj.weight"] = (a.num_heads * qk, d)
    out |= {"kv_a_proj_with_mqa.weight": (a.kv_lora_rank + a.qk_rope_head_dim, d),
            "kv_a_layernorm.weight": (a.kv_lora_rank,),
            "kv_b_proj.weight": (a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
            "o_proj.weight": (d, a.num_heads * a.v_head_dim)}
    if a.indexer:
        ix = a.indexer
        q_in = a.q_lora_rank or d
        out |= {"indexer.wq_b.weight": (ix.num_heads * ix.head_dim, q_in), "indexer.wk.weight": (ix.head_dim, d),
                "indexer.k_norm.weight": (ix.head_dim,), "indexer.k_norm.bias": (ix.head_dim,),
                "indexer.weights_proj.weight": (ix.num_heads, d)}
    return out


def _gated_delta(a: GatedDeltaAttention, d: int) -> Shapes:
    key, value = a.num_k_heads * a.head_k_dim, a.num_v_heads * a.head_v_dim
    conv = 2 * key + value
    out: Shapes = {"conv1d.weight": (conv, 1, a.conv_kernel_size), "A_log": (a.num_v_heads,),
                   "dt_bias": (a.num_v_heads,), "norm.weight": (a.head_v_dim,), "out_proj.weight": (d, value)}
    if a.fused_projections == "qkvz_ba":
        out |= {"in_proj_qkvz.weight": (2 * key + 2 * value, d), "in_proj_ba.weight": (2 * a.num_v_heads, d)}
    else:
        out |= {"in_proj_qkv.weight": (conv, d), "in_proj_z.weight": (value, d),
                "in_proj_b.weight": (a.num_v_heads, d), "in_proj_a.weight": (a.num_v_heads, d)}
    return out


def _kda(a: KDAAttention, d: int, gate_prefix: str) -> Shapes:
    width = a.num_heads * a.head_dim
    out: Shapes = {"q_proj.weight": (width, d), "k_proj.weight": (width, d), "v_proj.weight": (width, d),
                   "b_proj.weight": (a.num_heads, d), "g_a_proj.weight": (a.head_dim, d),
                   "g_b_proj.weight": (width, a.head_dim), "o_norm.weight": (a.head_dim,),
                   "o_proj.weight": (d, width),
                   gate_prefix + "A_log": (1, 1, a.num_heads, 1), gate_prefix + "dt_bias": (width,),
                   gate_prefix + "f_a_proj.weight": (a.head_dim, d),
                   gate_prefix + "f_b_proj.weight": (width, a.head_dim)}
    if a.separate_convs:
        out |= {f"{p}_conv1d.weight": (width, 1, a.conv_kernel_size) for p in "qkv"}
    else:
        out["conv1d.weight"] = (3 * width, 1, a.conv_kernel_size)
    return out


def _lightning(a: LightningAttention, d: int) -> Shapes:
    width = a.num_heads * a.head_dim
    return {"qkv_proj.weight": (3 * width, d), "output_gate.weight": (width, d), "norm.weight": (width,),
            "out_proj.weight": (d, width), "slope_rate": (a.num_heads, 1, 1),
            "query_decay": (a.num_heads, a.block_size, 1), "key_decay": (a.num_heads, a.block_size, 1),
            "diagonal_decay": (1, a.num_heads, a.block_size, a.block_size)}


def ffn_tensors(f, d: int, naming) -> Shapes:
    if isinstance(f, DenseFFN):
        return _mlp("", f.intermediate_size, d, f.bias)
    if isinstance(f, OwnModule):
        return {}
    return _moe(f, d, naming)


def _mlp(prefix: str, width: int, d: int, bias: bool = False) -> Shapes:
    out = {f"{prefix}gate_proj.weight": (width, d), f"{prefix}up_proj.weight": (width, d),
           f"{prefix}down_proj.weight": (d, width)}
    if bias:
        out |= {f"{prefix}gate_proj.bias": (width,), f"{prefix}up_proj.bias": (width,), f"{prefix}down_proj.bias": (d,)}
    return out


def _moe(f: MoEFFN, d: int, naming) -> Shapes:
    e = f.num_experts
    out: Shapes = {f"{naming.router_module}.weight": (e, d)}
    if f.router.bias:
        out[f"{naming.router_module}.bias"] = (e,)
    if f.router.correction_bias and naming.correction_bias:
        out[naming.correction_bias] = (1, e) if naming.correction_bias.startswith("moe_statics") else (e,)
    out |= _experts(f, d, naming.expert_style)
    if f.num_shared_experts:
        out |= _mlp(f"{naming.shared_module}.", f.shared_intermediate_size, d)
    if f.shared_expert_gate:
        out["shared_expert_gate.weight"] = (1, d)
    return out


def _experts(f: MoEFFN, d: int, style: str) -> Shapes:
    e, w = f.num_experts, f.expert_intermediate_size
    if style == "fused_gate_up":
        out = {"experts.gate_up_proj": (e, d, 2 * w), "experts.down_proj": (e, w, d)}
        if f.expert_bias:
            out |= {"experts.gate_up_proj_bias": (e, 2 * w), "experts.down_proj_bias": (e, d)}
        return out
    names = ("gate_proj", "up_proj", "down_proj") if style == "gate_up_down" else ("w1", "w3", "w2")
    out = {}
    for i in range(e):
        out |= {f"experts.{i}.{names[0]}.weight": (w, d), f"experts.{i}.{names[1]}.weight": (w, d),
                f"experts.{i}.{names[2]}.weight": (d, w)}
    return out
