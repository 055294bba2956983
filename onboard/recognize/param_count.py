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
        n = prod(shape)
        if name.startswith("experts."):
            routed += n
        elif name.startswith(spec.naming.shared_module) or name.startswith("shared_expert_gate"):
            c["experts_shared"] += n
        elif isinstance(ffn, MoEFFN):
            c["router"] += n
        else:
            c["ffn_dense"] += n
    c["experts_routed"] += routed
    return routed
