"""Total and active parameter counts from a ModelSpec (independent of the manifest, which checks them)."""
from __future__ import annotations

from math import prod

from onboard.recognize.packed import tensor_params
from onboard.recognize.weight_layout import attention_tensors, ffn_tensors
from runtime.spec import ModelSpec, MoEFFN, ParamCounts, VisionSpec, own_tensors

LIGHTNING_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def count(spec: ModelSpec, vision: VisionSpec | None) -> ParamCounts:
    d, v = spec.hidden_size, spec.vocab_size
    c = dict(embedding=v * d * (1 if spec.tie_word_embeddings else 2), attention=0, ffn_dense=0,
             experts_routed=0, experts_shared=0, router=0, norms=d, vision=vision.num_params if vision else 0,
             buffers=0)
    active_routed = 0
    for layer in spec.layers:
        # own modules: counted whole under their part (which of their tensors are experts is not known)
        for part, name in ((layer.attention, "attention"), (layer.ffn, "ffn_dense")):
            c[name] += sum(tensor_params(n, s) for n, s in own_tensors(part).items())
        c["norms"] += 0 if layer.own_layer else 2 * d
        attn = attention_tensors(layer.attention, d, spec.naming)
        buffers = sum(prod(s) for k, s in attn.items() if k in LIGHTNING_BUFFERS)
        c["buffers"] += buffers
        c["attention"] += sum(prod(s) for s in attn.values()) - buffers
        routed = _add_ffn(c, layer.ffn, d, spec)
        if isinstance(layer.ffn, MoEFFN):
            active_routed += routed * layer.ffn.top_k // layer.ffn.num_experts
    total = sum(val for key, val in c.items() if key != "buffers")
    return ParamCounts(total=total, active=total - c["experts_routed"] + active_routed, **c)


def _add_ffn(c: dict, ffn, d: int, spec: ModelSpec) -> int:
    """Adds the FFN's tensors to the categories; returns its routed-expert parameter count."""
    routed = 0
    for name, shape in ffn_tensors(ffn, d, spec.naming).items():
        category = ffn_category(name, ffn, spec)
        if category == "experts_routed":
            routed += prod(shape)
        else:
            c[category] += prod(shape)
    c["experts_routed"] += routed
    return routed


def ffn_category(name: str, ffn, spec: ModelSpec) -> str:
    """The ParamCounts category of an FFN tensor (its name under the FFN module)."""
    if name.startswith("experts."):
        return "experts_routed"
    if name.startswith(spec.naming.shared_module) or name.startswith("shared_expert_gate"):
        return "experts_shared"
    return "router" if isinstance(ffn, MoEFFN) else "ffn_dense"


def tensor_categories(spec: ModelSpec) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Released (logical) name -> (ParamCounts category, shape) of every text-model tensor `count` counts."""
    n, d = spec.naming, spec.hidden_size
    out = {f"{n.prefix}{n.embedding}.weight": ("embedding", (spec.vocab_size, d)),
           f"{n.prefix}{n.final_norm}.weight": ("norms", (d,))}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = ("embedding", (spec.vocab_size, d))
    for layer in spec.layers:
        for part, category in ((layer.attention, "attention"), (layer.ffn, "ffn_dense")):
            out |= {name: (category, tuple(shape)) for name, shape in own_tensors(part).items()}
        if layer.own_layer:
            continue
        base = f"{n.prefix}layers.{layer.index}."
        out |= {base + norm: ("norms", (d,)) for norm in ("input_layernorm.weight", "post_attention_layernorm.weight")}
        attn_module = n.softmax_module if layer.attention.kind in ("softmax", "mla") else n.linear_module
        for leaf, shape in attention_tensors(layer.attention, d, n).items():
            out[f"{base}{attn_module}.{leaf}"] = ("buffers" if leaf in LIGHTNING_BUFFERS else "attention", shape)
        for leaf, shape in ffn_tensors(layer.ffn, d, n).items():
            out[f"{base}{n.ffn_module}.{leaf}"] = (ffn_category(leaf, layer.ffn, spec), shape)
    return out
