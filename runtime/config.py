"""The runtime's typed view of a package's spec.json: frozen dataclasses parsed once by `ModelConfig.from_spec`.

spec.json is onboard's pydantic ModelSpec dumped to JSON; the runtime cannot import onboard, so these
classes mirror the part of it the runtime builds from (defaults as in ModelSpec) and ignore the rest
(naming, parameter counts, unrecognized items). Parsing walks each dataclass's annotated fields, so a
field's type is its validation; the attention config is chosen by the spec's `kind`. A malformed spec
raises one SpecError naming the key path, e.g. "spec.json: layers[3].attention.num_heads: missing".
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import ClassVar, Literal, Optional, Union


class SpecError(ValueError):
    """spec.json does not have the shape the runtime reads (the CLI reports it as bad input, exit 2)."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float  # base of the rotary frequencies
    rotary_dim: int  # channels of each head that rotate (partial rotary keeps the rest)
    interleaved: bool = False  # pairs (2i, 2i+1) instead of (i, i + R/2)
    scaling: Optional[dict] = None  # transformers rope_parameters (yarn, llama3...), read by runtime.ops.rope
    mrope_section: Optional[tuple[int, ...]] = None  # multimodal rope (t, h, w) sections, in rotary pairs
    mrope_interleaved: bool = False  # Qwen3-VL layout of the sections


@dataclass(frozen=True)
class SoftmaxAttentionConfig:
    kind: ClassVar[str] = "softmax"
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA groups)
    head_dim: int
    rope: Optional[RopeConfig]  # None: no rotary embedding
    qkv_bias: bool = False  # q/k/v projections have biases
    o_bias: bool = False  # output projection has a bias
    qk_norm: Literal["none", "head", "full"] = "none"  # RMSNorm over head_dim (Qwen3) or all heads (OLMoE)
    sliding_window: Optional[int] = None  # keys visible to a query; None: all earlier ones
    sinks: bool = False  # gpt-oss learned per-head sink logit
    output_gate: bool = False  # Qwen3-Next: q_proj also emits a sigmoid gate for the output
    scale: Optional[float] = None  # softmax scale; None: head_dim ** -0.5


@dataclass(frozen=True)
class DSAIndexerConfig:
    num_heads: int  # indexer heads
    head_dim: int  # indexer head width (its first rope_dim channels rotate)
    topk: int  # keys each query attends to


@dataclass(frozen=True)
class MLAConfig:
    kind: ClassVar[str] = "mla"
    num_heads: int
    q_lora_rank: Optional[int]  # None: queries straight from the hidden state (no low-rank q path)
    kv_lora_rank: int  # width of the shared kv latent
    qk_nope_head_dim: int  # query/key channels without rotation
    qk_rope_head_dim: int  # query/key channels with rotation
    v_head_dim: int
    rope: Optional[RopeConfig]  # None: NoPE MLA (Kimi)
    indexer: Optional[DSAIndexerConfig] = None  # DeepSeek sparse attention on top of MLA
    scale: Optional[float] = None  # None: from the head width and yarn's mscale


@dataclass(frozen=True)
class GatedDeltaConfig:
    kind: ClassVar[str] = "gated_delta"
    num_k_heads: int  # query/key heads; value heads share them in groups
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int  # width of the causal short convolution
    fused_projections: Literal["qkvz_ba", "qkv_z_b_a"]  # Qwen3-Next vs Qwen3.5 tensor layout
    # log-decay from a, A_log, dt_bias: "softplus" (-exp(A_log) softplus(a + dt_bias)) or a generated form
    # (runtime/ops/gated_delta.py DECAYS)
    decay: str = "softplus"


@dataclass(frozen=True)
class KDAConfig:
    kind: ClassVar[str] = "kda"
    num_heads: int
    head_dim: int
    conv_kernel_size: int  # width of the causal short convolution
    separate_convs: bool = True  # q/k/v_conv1d (Kimi Linear) vs one fused conv1d
    output_gate_activation: Literal["sigmoid", "silu"] = "sigmoid"  # of the gated output norm


@dataclass(frozen=True)
class LightningConfig:
    kind: ClassVar[str] = "lightning"
    num_heads: int
    head_dim: int
    block_size: int  # side of the decay tables the release stores


@dataclass(frozen=True)
class OwnModuleConfig:
    """A part no registry op computes: transformers' own module runs it (runtime/own_modules.py)."""
    kind: ClassVar[str] = "own_module"
    path: str = ""  # attribute path of the module inside transformers' decoder layer ("" for the whole layer)


AttentionConfig = Union[SoftmaxAttentionConfig, MLAConfig, GatedDeltaConfig, KDAConfig, LightningConfig,
                        OwnModuleConfig]


@dataclass(frozen=True)
class DenseFFNConfig:
    kind: ClassVar[str] = "dense"
    intermediate_size: int  # width of the gated MLP
    activation: str = "silu"  # of the gate


@dataclass(frozen=True)
class RouterConfig:
    scoring: str  # logits to expert scores: "softmax" or "sigmoid" (the gap report marks any other missing)
    norm_topk_prob: bool  # renormalize the chosen k scores to sum to 1
    routed_scaling_factor: float = 1.0  # multiplies the routing weights
    correction_bias: bool = False  # bias steering selection only (DeepSeek noaux_tc)
    num_groups: int = 1  # expert groups for group-limited top-k
    topk_groups: int = 1  # groups a token may pick experts from
    topk_before_softmax: bool = False  # Mixtral / gpt-oss: softmax over the chosen k logits
    bias: bool = False  # router linear has a bias (gpt-oss)
    aux_loss_coef: Optional[float] = None  # the release's load-balancing loss coefficient (training only)


@dataclass(frozen=True)
class MoEConfig:
    kind: ClassVar[str] = "moe"
    num_experts: int  # routed experts
    top_k: int  # experts per token
    expert_intermediate_size: int  # width of one routed expert
    router: RouterConfig
    num_shared_experts: int = 0  # 0: no shared expert
    shared_intermediate_size: int = 0  # total width of the shared expert MLP
    shared_expert_gate: bool = False  # Qwen: sigmoid(x . w) scales the shared expert
    activation: str = "silu"  # of the experts' gate
    expert_bias: bool = False  # experts' projections have biases (gpt-oss)
    swiglu_limit: Optional[float] = None  # gpt-oss clamp of gate and up
    swiglu_alpha: Optional[float] = None  # gpt-oss sigmoid slope in the gate
    interleaved_gate_up: bool = False  # gate and up rows alternate in the stacked weight


FFNConfig = Union[DenseFFNConfig, MoEConfig, OwnModuleConfig]


@dataclass(frozen=True)
class NormConfig:
    # rms_1p: weight stored as w, applied as (1 + w); another name: a norm the package generated (runtime/ops/norms.py)
    kind: str
    eps: float

    @property
    def offset(self) -> float:
        return 1.0 if self.kind == "rms_1p" else 0.0


@dataclass(frozen=True)
class ResidualConfig:
    """h = skip * alpha + sublayer * beta, skip being the block input (pre-norm) or its normed form (MiniMax)."""
    skip_from_normed: bool = False
    attn_alpha: float = 1.0
    attn_beta: float = 1.0
    ffn_alpha: float = 1.0
    ffn_beta: float = 1.0
    # "weighted_sum" is the line above; another name: a mixing the package generated (runtime/ops/residual.py)
    mixing: str = "weighted_sum"


@dataclass(frozen=True)
class LayerConfig:
    attention: AttentionConfig
    ffn: FFNConfig
    residual: ResidualConfig = ResidualConfig()
    own_layer: Optional[str] = None  # why the whole decoder layer runs as transformers' own module


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int  # model width D
    vocab_size: int
    layers: tuple[LayerConfig, ...]
    norm: NormConfig  # every RMSNorm of the decoder (layers, final, qk-norm)
    tie_word_embeddings: bool  # LM head is the embedding matrix
    final_logit_softcapping: Optional[float] = None  # logits = c * tanh(z / c); None: plain logits
    # why the whole model runs as transformers' own (runtime/own_modules.py OwnModel); None: assembled here
    own_model: Optional[str] = None

    @classmethod
    def from_spec(cls, spec: dict, source: str = "spec.json") -> ModelConfig:
        """Parse the spec dict once; SpecError names `source` and the key path of the first problem."""
        try:
            return _parse(cls, spec, "")
        except SpecError as error:
            raise SpecError(f"{source}: {error}") from None


def _parse(hint, value, path: str):
    """value as type `hint` (a dataclass, Optional, Union of kind-tagged dataclasses, tuple, Literal or scalar)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return _parse_union(args, value, path)
    if dataclasses.is_dataclass(hint):
        return _parse_dataclass(hint, value, path)
    if origin is tuple:
        items = _expect(value, (list, tuple), "a list", path)
        return tuple(_parse(args[0], item, f"{path}[{i}]") for i, item in enumerate(items))
    if origin is Literal:
        if value not in args:
            raise _error(path, f"expected one of {list(args)}, got {value!r}")
        return value
    return _scalar(hint, value, path)


def _parse_dataclass(cls, value, path: str):
    data = _expect(value, dict, "an object", path)
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        key = f"{path}.{field.name}".lstrip(".")
        if field.name in data:
            values[field.name] = _parse(hints[field.name], data[field.name], key)
        elif field.default is dataclasses.MISSING:
            raise _error(key, "missing")
    return cls(**values)


def _parse_union(options: tuple, value, path: str):
    if value is None and type(None) in options:
        return None
    choices = [option for option in options if option is not type(None)]
    if len(choices) == 1:
        return _parse(choices[0], value, path)
    by_kind = {option.kind: option for option in choices}
    kind = _expect(value, dict, "an object", path).get("kind")
    if kind not in by_kind:
        raise _error(f"{path}.kind".lstrip("."), f"expected one of {list(by_kind)}, got {kind!r}")
    return _parse_dataclass(by_kind[kind], value, path)


SCALARS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "an object"}


def _scalar(hint, value, path: str):
    # bool is an int in Python, and JSON has one number type: float fields accept integers (as pydantic does)
    accepted = (int, float) if hint is float else hint
    if isinstance(value, bool) and hint is not bool:
        accepted = ()
    _expect(value, accepted, SCALARS[hint], path)
    return float(value) if hint is float else value


JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "object"}


def _expect(value, types_, what: str, path: str):
    if not isinstance(value, types_):
        got = "null" if value is None else f"{JSON_TYPES.get(type(value), type(value).__name__)} {value!r}"
        raise _error(path, f"expected {what}, got {got}")
    return value


def _error(path: str, problem: str) -> SpecError:
    return SpecError(f"{path}: {problem}" if path else problem)
