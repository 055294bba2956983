"""The operator registry: one table of op families read by gap analysis, alignment tier 0 and the runtime.

Each family names its fp64 reference op, its torch form (plain torch, runs everywhere) and (where one exists) its
fused kernel as "module:function" strings, so reading the table imports nothing heavy; runtime/dispatch.py picks
between the torch form and the kernel through the backend selector beside the kernel module (runtime/ops/<op>/backend.py).
`supports` says whether the family computes a component with given parameters exactly, as a variant (same op, a
parameter path exercised less), or not at all.

Predicates and `ops_for_layer` take the ModelSpec's own parts (runtime/spec.py: a NormSpec, a RopeSpec,
an attention or FFN spec): their callers are onboard's gap analysis, the agents' tasks and alignment tiers 0
and 2, which judge a spec before any runtime model exists. The runtime's layers never ask.
"""
from __future__ import annotations

import importlib
import sys
import importlib.util
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict

from runtime.formats.scheme import StoredFormat
from runtime.spec import FFN, Attention, AttnResSpec, DenseFFN, GatedDeltaAttention, MLAAttention, MoEFFN, NormSpec, RopeSpec

Support = Literal["exact", "variant", "unsupported"]
# the part of a ModelSpec an op family's predicate judges: the model's norm, a layer's rope, attention or FFN, or
# (StoredWeights, below) the release's stored format of a layer's frozen weights, or the model's attention residuals
SpecPart = Union[NormSpec, RopeSpec, Attention, FFN, "StoredWeights", AttnResSpec]

ROPE_TYPES = {"default", "linear", "yarn", "llama3", "dynamic"}


@dataclass(frozen=True)
class OpFamily:
    name: str
    covers: str  # the spec component it computes, e.g. "attention:gated_delta"
    reference: str
    torch_form: str
    kernel: Optional[str]
    supports: Callable[[SpecPart], Support]

    def resolve(self, which: Literal["reference", "torch_form", "kernel"]):
        """Import and return the implementation; None when that module or function does not exist."""
        target = getattr(self, which)
        if target is None:
            return None
        module_name, fn_name = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            return None
        return getattr(module, fn_name, None)

    def exists(self, which: Literal["reference", "torch_form", "kernel"]) -> bool:
        """Whether that implementation's module is in this tree, without importing it (no torch,
        no triton): gap analysis needs only this, and every entry resolving is a registry test."""
        target = getattr(self, which)
        return target is not None and importlib.util.find_spec(target.split(":")[0]) is not None


def _always(part: SpecPart) -> Support:
    return "exact"


def _generated(module: str, table: str, name: str) -> bool:
    """Whether a package registered a generated op `name` into runtime `module`'s `table` (which a package
    loading has imported; reading the registry imports no torch)."""
    loaded = sys.modules.get(module)
    return loaded is not None and name in getattr(loaded, table)


def _norm(norm: NormSpec) -> Support:
    kind = norm.kind
    if kind in ("rms", "rms_1p"):
        return "exact"
    return "variant" if _generated("runtime.ops.norm.torch_form", "NORMS", kind) else "unsupported"


def _rope(rope: RopeSpec) -> Support:
    scaling = rope.scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        generated = _generated("runtime.ops.rope.torch_form", "ROPES", rope_type)
        return "variant" if generated and not rope.mrope_section else "unsupported"
    return "variant" if rope_type == "dynamic" else "exact"


def _gated_delta(attention: GatedDeltaAttention) -> Support:
    decay = attention.decay
    if decay == "softplus":
        return "exact"
    return "variant" if _generated("runtime.ops.gated_delta.torch_form", "DECAYS", decay) else "unsupported"


def _softmax(attention: Attention) -> Support:
    return "exact"


def _mla(attention: MLAAttention) -> Support:
    return "exact" if attention.indexer is None else "unsupported"


def _dsa(attention: MLAAttention) -> Support:
    return "exact" if attention.indexer is not None else "unsupported"


BUILTIN_SCORINGS = ("softmax", "sigmoid")


def _router(ffn: MoEFFN) -> Support:
    """softmax and sigmoid are built in (the kernel fuses softmax); a scoring a package generated runs unfused."""
    scoring = ffn.router.scoring
    if scoring in BUILTIN_SCORINGS:
        return "exact"
    return "variant" if _generated("runtime.ops.moe.torch_form", "SCORINGS", scoring) else "unsupported"


# the activations runtime/ops/mlp/torch_form.py's ACTIVATIONS holds before any package registers generated ones;
# named here so that reading the table imports no torch (`inspect` stays light); a test keeps the two equal
BUILTIN_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")


def _activation(ffn: Union[DenseFFN, MoEFFN]) -> Support:
    """silu (and SiTU-GLU with its betas) are the paths the kernels fuse; other activations the runtime has (or a
    package generated) run unfused."""
    name = ffn.activation
    if name == "silu":
        return "exact"
    if name == "situ":
        # Kimi K3's SiTU-GLU: the experts' GEMM epilogue fuses it; without its beta it cannot be computed
        return "exact" if ffn.situ_beta is not None else "unsupported"
    # generated activations are registered into runtime.ops.mlp.torch_form, so it is loaded whenever there are any
    mlp = sys.modules.get("runtime.ops.mlp.torch_form")
    known = mlp.ACTIVATIONS if mlp is not None else BUILTIN_ACTIVATIONS
    return "variant" if name in known else "unsupported"


class StoredWeights(BaseModel):
    """The part a stored-weight op judges: the release's stored format, and for the routed experts their FFN."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    format: StoredFormat
    ffn: Optional[MoEFFN] = None


def _stored_format(part: StoredWeights) -> Support:
    """Both formats of runtime/formats/scheme.py decode in the kernels' tiles."""
    return "exact" if part.format.kind in STORED_KINDS else "unsupported"


def _stored_experts(part: StoredWeights) -> Support:
    if part.ffn is None or _stored_format(part) == "unsupported":
        return "unsupported"
    return _activation(part.ffn)


STORED_KINDS = ("fp8_block", "mxfp4")


OPS: dict[str, OpFamily] = {op.name: op for op in [
    OpFamily("rms_norm", "norm", "reference_ops.norms:rms_norm", "runtime.ops.norm.torch_form:rms_norm",
             "runtime.ops.norm.kernel:rms_norm", _norm),
    OpFamily("gated_rms_norm", "attention:linear_output_norm", "reference_ops.norms:gated_rms_norm",
             "runtime.ops.norm.torch_form:gated_rms_norm", "runtime.ops.norm.kernel:gated_rms_norm", _always),
    OpFamily("rope", "rope", "reference_ops.rope:apply_rope", "runtime.ops.rope.torch_form:apply_rope", None, _rope),
    OpFamily("softmax_attention", "attention:softmax", "reference_ops.attention:softmax_attention",
             "runtime.ops.attention.torch_form:softmax_attention", None, _softmax),
    OpFamily("mla_attention", "attention:mla", "reference_ops.mla:mla_attention",
             "runtime.ops.mla.torch_form:mla_attention", None, _mla),
    OpFamily("dsa_indexer", "attention:mla_dsa", "reference_ops.dsa:indexer_topk",
             "runtime.ops.dsa.torch_form:indexer_topk", "runtime.ops.dsa.kernel:indexer_topk", _dsa),
    OpFamily("dsa_attention", "attention:mla_dsa", "reference_ops.dsa:sparse_attention",
             "runtime.ops.dsa.torch_form:sparse_attention", "runtime.ops.dsa.kernel:sparse_attention", _dsa),
    OpFamily("causal_conv1d", "attention:short_conv", "reference_ops.conv:causal_conv1d",
             "runtime.ops.conv.torch_form:causal_conv1d", "runtime.ops.conv.kernel:causal_conv1d", _always),
    OpFamily("gated_delta_rule", "attention:gated_delta", "reference_ops.gated_delta:gated_delta_rule",
             "runtime.ops.gated_delta.torch_form:gated_delta_rule", "runtime.ops.gated_delta.kernel:gated_delta_rule",
             _gated_delta),
    OpFamily("kda", "attention:kda", "reference_ops.kda:kda", "runtime.ops.gated_delta.kda_torch_form:kda",
             "runtime.ops.gated_delta.kernel:kda", _always),
    OpFamily("lightning_attention", "attention:lightning", "reference_ops.lightning:lightning_attention",
             "runtime.ops.lightning.torch_form:lightning_attention", None, _always),
    OpFamily("moe_router", "ffn:moe", "reference_ops.moe:route", "runtime.ops.moe.torch_form:route",
             "runtime.ops.moe.kernel:route", _router),
    OpFamily("moe_experts", "ffn:moe", "reference_ops.moe:swiglu_experts", "runtime.ops.moe.torch_form:swiglu_experts",
             "runtime.ops.moe.kernel:swiglu_experts", _activation),
    OpFamily("cross_entropy_rows", "head:loss", "reference_ops.loss:cross_entropy_rows",
             "runtime.ops.loss.torch_form:cross_entropy_rows", "runtime.ops.loss.kernel:cross_entropy_rows", _always),
    OpFamily("attn_res_mix", "residual:attn_res", "reference_ops.attn_res:attn_res_mix",
             "runtime.ops.attn_res.torch_form:attn_res_mix", None, _always),
    OpFamily("swiglu_mlp", "ffn:dense", "reference_ops.mlp:swiglu_mlp", "runtime.ops.mlp.torch_form:swiglu_mlp",
             "runtime.ops.mlp.kernel:swiglu_mlp", _activation),
    OpFamily("stored_linear", "weights:stored", "reference_ops.stored:stored_linear",
             "runtime.ops.stored_matmul.torch_form:stored_linear", "runtime.ops.stored_matmul.kernel:stored_linear",
             _stored_format),
    OpFamily("moe_experts_stored", "ffn:moe", "reference_ops.stored:stored_swiglu_experts",
             "runtime.ops.moe.torch_form:stored_swiglu_experts", "runtime.ops.moe.kernel:stored_swiglu_experts",
             _stored_experts),
]}


def ops_for_layer(attention: Attention, ffn: FFN, stored: Optional[StoredFormat] = None,
                  attn_res: Optional[AttnResSpec] = None) -> list[tuple[str, SpecPart]]:
    """The op families one decoder layer uses, each with the spec part its predicate judges. With the release's
    stored format, the routed experts read their frozen weights stored (moe_experts_stored), and so do the layer's
    projections where the format stores them: FP8 releases quantize the linears, MXFP4 ones (gpt-oss, Kimi K3) only
    the experts."""
    kind = attention.kind
    used: list[tuple[str, SpecPart]] = []
    if kind == "softmax":
        used.append(("softmax_attention", attention))
    elif kind == "mla":
        used += [("dsa_indexer", attention), ("dsa_attention", attention)] if attention.indexer \
            else [("mla_attention", attention)]
    elif kind == "gated_delta":
        used += [("causal_conv1d", attention), ("gated_delta_rule", attention), ("gated_rms_norm", attention)]
    elif kind == "kda":
        used += [("causal_conv1d", attention), ("kda", attention), ("gated_rms_norm", attention)]
    elif kind == "lightning":
        used.append(("lightning_attention", attention))
    if kind in ("softmax", "mla") and attention.rope is not None:  # None: no rotary embedding (NoPE)
        used.append(("rope", attention.rope))
    # own modules (kind "own_module") run through the model's own implementation: no registry op
    if stored is not None and stored.kind == "fp8_block":
        used.append(("stored_linear", StoredWeights(format=stored)))
    if ffn.kind == "moe":
        experts = ("moe_experts", ffn) if stored is None else ("moe_experts_stored", StoredWeights(format=stored, ffn=ffn))
        used += [("moe_router", ffn), experts]
        if ffn.num_shared_experts:
            used.append(("swiglu_mlp", ffn))
    elif ffn.kind == "dense":
        used.append(("swiglu_mlp", ffn))
    if attn_res is not None:  # the model's (ModelSpec.attn_res): every layer mixes its sublayers' inputs
        used.append(("attn_res_mix", attn_res))
    return used
