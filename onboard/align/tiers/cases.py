"""Tier-0 inputs: for each registry op, random arguments at a layer's real widths and a short sequence.

A case is (args, kwargs, grads): `grads` names the float tensors whose gradients are compared.
Tensors are made in fp64, then rounded to the tested dtype; the reference gets the same rounded
values, so a comparison measures the op, not the input rounding. Expert counts above MAX_EXPERTS
are cut (widths stay real): the flagship's 896 stacked experts would need 128 GB.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel

from runtime.formats.codec import fp8_block_encode, mxfp4_encode
from runtime.ops.rope.torch_form import rope_cos_sin, rope_inv_freq

MAX_EXPERTS = 8


class Case:
    def __init__(self, gen: torch.Generator, dtype: torch.dtype):
        self.gen, self.dtype = gen, dtype
        self.kwargs: dict = {}
        self.grads: list[str] = []
        # tensors passed to both sides as they are (a release's stored codes and scales: never cast, no gradient)
        self.frozen: set[str] = set()

    def rand(self, name: str, *shape: int, scale: float = 1.0, offset: float = 0.0, grad: bool = True) -> torch.Tensor:
        """A random input; a dotted name ("params.q_proj") lands in a dict argument, one with a number ("lora.0") in a
        tuple argument."""
        value = (torch.randn(shape, generator=self.gen, dtype=torch.float64) * scale + offset).to(self.dtype)
        self.kwargs[name] = value
        if grad:
            self.grads.append(name)
        return value

    def set(self, name: str, value) -> None:
        self.kwargs[name] = value


def _rope_tables(rope: dict, T: int):
    inv_freq, factor = rope_inv_freq(rope["rotary_dim"], rope["theta"], rope.get("scaling"))
    return rope_cos_sin(torch.arange(T)[None], inv_freq, factor)


def build_case(op: str, part: BaseModel, hidden: int, T: int, seed: int, dtype: torch.dtype) -> Case:
    """part: the spec part the op computes (runtime/registry.py's SpecPart); the builders read its fields as
    the plain data they pass to the op."""
    case = Case(torch.Generator().manual_seed(seed), dtype)
    BUILDERS[op](case, part.model_dump(mode="json"), hidden, T)
    return case


def _norm(c: Case, p: dict, d: int, T: int):
    c.rand("x", 1, T, d)
    c.rand("weight", d, scale=0.1)
    c.set("eps", p["eps"])
    c.set("offset", 1.0 if p["kind"] == "rms_1p" else 0.0)


def _gated_norm(c: Case, p: dict, d: int, T: int):
    heads, width = (p["num_v_heads"], p["head_v_dim"]) if p["kind"] == "gated_delta" else (p["num_heads"], p["head_dim"])
    c.rand("x", 1, T, heads, width)
    c.rand("gate", 1, T, heads, width)
    c.rand("weight", width, scale=0.1)
    c.set("eps", 1e-6)
    c.set("activation", p.get("output_gate_activation", "silu"))


def _rope(c: Case, p: dict, d: int, T: int):
    c.rand("x_BTHK", 1, T, 2, max(p["rotary_dim"], 2))
    cos, sin = _rope_tables(p, T)
    c.set("cos_BTR", cos)
    c.set("sin_BTR", sin)
    c.set("interleaved", p.get("interleaved", False))


def _softmax(c: Case, p: dict, d: int, T: int):
    c.rand("q_BTHK", 1, T, p["num_heads"], p["head_dim"])
    c.rand("k_BTGK", 1, T, p["num_kv_heads"], p["head_dim"])
    c.rand("v_BTGV", 1, T, p["num_kv_heads"], p["head_dim"])
    c.set("scale", p["head_dim"] ** -0.5)
    c.set("window", p["sliding_window"])
    if p["sinks"]:
        c.rand("sinks_H", p["num_heads"])


def _mla(c: Case, p: dict, d: int, T: int):
    qk, H = p["qk_nope_head_dim"] + p["qk_rope_head_dim"], p["num_heads"]
    c.rand("x_BTD", 1, T, d)
    shapes = {"kv_a_proj_with_mqa": (p["kv_lora_rank"] + p["qk_rope_head_dim"], d),
              "kv_a_layernorm": (p["kv_lora_rank"],),
              "kv_b_proj": (H * (p["qk_nope_head_dim"] + p["v_head_dim"]), p["kv_lora_rank"]),
              "o_proj": (d, H * p["v_head_dim"])}
    if p.get("output_gate"):
        shapes["g_proj"] = (H * p["v_head_dim"], d)
    if p["q_lora_rank"]:
        shapes |= {"q_a_proj": (p["q_lora_rank"], d), "q_a_layernorm": (p["q_lora_rank"],), "q_b_proj": (H * qk, p["q_lora_rank"])}
    else:
        shapes["q_proj"] = (H * qk, d)
    for name, shape in shapes.items():
        # norm weights near 1, projections scaled to keep activations O(1)
        if len(shape) == 1:
            c.rand(f"params.{name}", *shape, scale=0.1, offset=1.0)
        else:
            c.rand(f"params.{name}", *shape, scale=shape[1] ** -0.5)
    rope = p["rope"] or {"rotary_dim": p["qk_rope_head_dim"], "theta": 10000.0}
    cos, sin = _rope_tables({**rope, "rotary_dim": p["qk_rope_head_dim"]}, T)
    if p["rope"] is None:
        cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
    c.kwargs.update(num_heads=H, q_lora_rank=p["q_lora_rank"], kv_lora_rank=p["kv_lora_rank"],
                    qk_nope_head_dim=p["qk_nope_head_dim"], qk_rope_head_dim=p["qk_rope_head_dim"],
                    v_head_dim=p["v_head_dim"], cos_BTR=cos, sin_BTR=sin, scale=qk ** -0.5, eps=1e-6,
                    interleaved_rope=bool(p["rope"] and p["rope"].get("interleaved")))


def _indexer(c: Case, p: dict, d: int, T: int):
    ix = p["indexer"]
    c.rand("q_BTHK", 1, T, ix["num_heads"], ix["head_dim"], grad=False)
    c.rand("k_BTK", 1, T, ix["head_dim"], grad=False)
    c.rand("weights_BTH", 1, T, ix["num_heads"], grad=False)
    c.set("scale", ix["head_dim"] ** -0.5)
    # a top-k below T so the selection matters at short sequences
    c.set("topk", min(ix["topk"], max(T // 4, 1)))


def _sparse(c: Case, p: dict, d: int, T: int):
    width = p["kv_lora_rank"] + p["qk_rope_head_dim"]
    c.rand("q_BTHK", 1, T, p["num_heads"], width)
    c.rand("kv_BTK", 1, T, width)
    scores = torch.randn(1, T, T, generator=c.gen, dtype=torch.float64).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    S = min(p["indexer"]["topk"], max(T // 4, 1))
    values, idx = scores.topk(S, dim=-1)
    c.set("idx_BTS", idx.masked_fill(values == float("-inf"), -1))
    c.set("scale", (p["qk_nope_head_dim"] + p["qk_rope_head_dim"]) ** -0.5)
    c.set("v_dim", p["kv_lora_rank"])


def _conv(c: Case, p: dict, d: int, T: int):
    if p["kind"] == "gated_delta":
        channels = 2 * p["num_k_heads"] * p["head_k_dim"] + p["num_v_heads"] * p["head_v_dim"]
    else:
        channels = 3 * p["num_heads"] * p["head_dim"]
    c.rand("x_BTC", 1, T, channels)
    c.rand("weight_CW", channels, p["conv_kernel_size"], scale=0.5)
    c.set("bias_C", None)
    c.set("activation", "silu")


def _delta(c: Case, p: dict, d: int, T: int):
    per_channel = p["kind"] == "kda"
    H = p["num_heads"] if per_channel else p["num_v_heads"]
    K = p["head_dim"] if per_channel else p["head_k_dim"]
    V = p["head_dim"] if per_channel else p["head_v_dim"]
    c.rand("q_BTHK", 1, T, H, K)
    c.rand("k_BTHK", 1, T, H, K)
    c.rand("v_BTHV", 1, T, H, V)
    g_shape = (1, T, H, K) if per_channel else (1, T, H)
    g = -F.softplus(torch.randn(g_shape, generator=c.gen, dtype=torch.float64)).to(c.dtype) * 0.5
    c.set("g_BTHK" if per_channel else "g_BTH", g)
    c.grads.append("g_BTHK" if per_channel else "g_BTH")
    c.set("beta_BTH", torch.rand(1, T, H, generator=c.gen, dtype=torch.float64).to(c.dtype))
    c.grads.append("beta_BTH")
    c.set("use_qk_l2norm", True)


def _lightning(c: Case, p: dict, d: int, T: int):
    for name in ("q_BTHK", "k_BTHK", "v_BTHV"):
        c.rand(name, 1, T, p["num_heads"], p["head_dim"], scale=0.5)
    base = 2 ** (-8 / p["num_heads"])
    c.set("slope_H", torch.tensor([base ** (h + 1) for h in range(p["num_heads"])], dtype=torch.float64).to(c.dtype))


def _router(c: Case, p: dict, d: int, T: int):
    r = p["router"]
    c.rand("logits_TE", T, p["num_experts"], grad=False)
    c.set("top_k", p["top_k"])
    c.kwargs.update(scoring=r["scoring"], norm_topk_prob=r["norm_topk_prob"], routed_scaling_factor=r["routed_scaling_factor"],
                    num_groups=r["num_groups"], topk_groups=r["topk_groups"], topk_before_softmax=r["topk_before_softmax"])
    if r["correction_bias"]:
        c.rand("correction_bias_E", p["num_experts"], scale=0.1, grad=False)


def _experts(c: Case, p: dict, d: int, T: int):
    E, F_ = min(p["num_experts"], MAX_EXPERTS), p["expert_intermediate_size"]
    d = p.get("latent_size") or d  # a latent MoE's experts run at the latent width (Kimi K3)
    k = min(p["top_k"], E)
    c.rand("x_TD", T, d)
    scores = torch.rand(T, E, generator=c.gen, dtype=torch.float64)
    top, idx = scores.topk(k, dim=-1)
    c.set("weights_Tk", (top / top.sum(-1, keepdim=True)).float())
    c.set("idx_Tk", idx)
    c.rand("w_gate_up_E2FD", E, 2 * F_, d, scale=d ** -0.5)
    c.rand("w_down_EDF", E, d, F_, scale=F_ ** -0.5)
    if p["expert_bias"]:
        c.rand("b_gate_up_E2F", E, 2 * F_, scale=0.1)
        c.rand("b_down_ED", E, d, scale=0.1)
    c.kwargs.update(clamp=p["swiglu_limit"], glu_alpha=p["swiglu_alpha"], interleaved_gate_up=p["interleaved_gate_up"],
                    **activation_kwargs(p))


def activation_kwargs(p: dict) -> dict:
    """The FFN ops' activation keywords: its name, and SiTU-GLU's (beta, linear_beta) where the spec holds them."""
    if p["activation"] == "situ" and p.get("situ_beta") is not None:
        return dict(activation="situ", situ_betas=(p["situ_beta"], p.get("situ_linear_beta")))
    return dict(activation=p["activation"])


def _mlp(c: Case, p: dict, d: int, T: int):
    width = p["intermediate_size"] if p["kind"] == "dense" else p["shared_intermediate_size"]
    c.rand("x_TD", T, d)
    c.rand("w_gate_FD", width, d, scale=d ** -0.5)
    c.rand("w_up_FD", width, d, scale=d ** -0.5)
    c.rand("w_down_DF", d, width, scale=width ** -0.5)
    c.kwargs.update(activation_kwargs(p))


# sources of a tier-0 attention-residual mix: two completed blocks and the partial sum (a real model's count grows
# with depth; the mix is the same function of each)
ATTN_RES_SOURCES = 3


def _attn_res(c: Case, p: dict, d: int, T: int):
    for n in range(ATTN_RES_SOURCES):
        # block sums grow with the sublayers summed into them: sources of unequal scale, as in a real stream
        c.rand(f"sources.{n}", 1, T, d, scale=1.0 + n)
    c.rand("query_D", d, scale=d ** -0.5)
    c.rand("norm_weight_D", d, scale=0.1, offset=1.0)
    c.set("eps", 1e-6)


def _encoded(c: Case, shape: tuple[int, ...], fmt: dict, scale: float):
    """(codes, scale) of a random weight encoded in the release's format (frozen: no gradient)."""
    weight = torch.randn(shape, generator=c.gen, dtype=torch.float64) * scale
    if fmt["kind"] == "mxfp4":
        return mxfp4_encode(weight)
    return fp8_block_encode(weight, tuple(fmt["block"]), power_of_two=fmt["power_of_two"])


def _stored_kwargs(fmt: dict) -> dict:
    return dict(kind=fmt["kind"], block=tuple(fmt["block"]) if fmt["kind"] == "fp8_block" else None)


def _stored_linear(c: Case, p: dict, d: int, T: int):
    """A projection at the model's width, its weight stored in the release's format."""
    c.rand("x_TI", T, d)
    codes, scale = _encoded(c, (d, d), p["format"], d ** -0.5)
    c.set("codes", codes)
    c.set("scale", scale)
    c.kwargs.update(_stored_kwargs(p["format"]))


def _stored_experts(c: Case, p: dict, d: int, T: int):
    """The routed experts' case (_experts) with both base weights encoded in the release's format."""
    _experts(c, p["ffn"], d, T)
    for name, prefix in (("w_gate_up_E2FD", "gate_up"), ("w_down_EDF", "down")):
        weight = c.kwargs.pop(name)
        c.grads.remove(name)
        codes, scale = _encoded(c, tuple(weight.shape), p["format"], weight.shape[-1] ** -0.5)
        c.set(f"{prefix}_codes", codes)
        c.set(f"{prefix}_scale", scale)
    c.kwargs.update(_stored_kwargs(p["format"]))


BUILDERS = {
    "attn_res_mix": _attn_res,
    "rms_norm": _norm, "gated_rms_norm": _gated_norm, "rope": _rope, "softmax_attention": _softmax,
    "mla_attention": _mla, "dsa_indexer": _indexer, "dsa_attention": _sparse, "causal_conv1d": _conv,
    "gated_delta_rule": _delta, "kda": _delta, "lightning_attention": _lightning, "moe_router": _router,
    "moe_experts": _experts, "swiglu_mlp": _mlp, "stored_linear": _stored_linear, "moe_experts_stored": _stored_experts,
}
