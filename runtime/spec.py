"""ModelSpec: the normalized architecture of a release, as recognized from config keys and weight names.

Written once, read by both sides: onboard/ builds it (recognition) and judges it (gap report, planning,
alignment); the runtime builds its model from it (runtime/model/decoder.py), reading a package's spec.json with
`read_spec`. Everything downstream reads this and never the raw config. Widths are in elements; parameter
counts in parameters (not bytes).
"""
from __future__ import annotations

import hashlib
from typing import Annotated, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from runtime.formats.scheme import StoredFormat


class WeightNaming(BaseModel):
    """How a release names its tensors: detected from the weight names (onboard/release/naming.py), then used to list
    the tensors the spec expects and to map them to the runtime's names."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix: str  # text decoder prefix, e.g. "model." or "model.language_model."
    softmax_module: str = "self_attn"
    linear_module: str = "self_attn"  # Qwen3-Next names its gated delta net "linear_attn"
    ffn_module: str = "mlp"
    expert_style: Literal["gate_up_down", "w1_w3_w2", "fused_gate_up"] = "gate_up_down"
    router_module: str = "gate"
    correction_bias: Optional[str] = None  # path under the FFN module
    shared_module: str = "shared_experts"
    kda_gate_prefix: str = ""  # the seed release nests A_log/dt_bias/f_a/f_b under "forget_gate."
    final_norm: str = "norm"  # the decoder's last norm, under prefix (Jamba: "final_layernorm")
    embedding: str = "embed_tokens"  # the token embedding, under prefix (Ling: "word_embeddings")
    vision_prefix: Optional[str] = None


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # fields added after packages were written: left out of the dump (spec.json, the spec hash) while they hold
    # their default, so that a spec that does not use them reads and hashes as it did before they existed
    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _without_late_defaults(self, handler):
        data = handler(self)
        for name in self._LATE_FIELDS:
            if isinstance(data, dict) and name in data and getattr(self, name) == type(self).model_fields[name].default:
                del data[name]
        return data


class RopeSpec(_Spec):
    theta: float
    rotary_dim: int  # channels of each head that rotate (partial rotary keeps the rest)
    interleaved: bool = False  # DeepSeek/GLM-style pairwise (0,1),(2,3) rotation
    scaling: Optional[dict] = None  # transformers rope_parameters minus theta/partial factor
    mrope_section: Optional[list[int]] = None  # multimodal rope (t, h, w) sections, in rotary pairs
    mrope_interleaved: bool = False


class SoftmaxAttention(_Spec):
    kind: Literal["softmax"] = "softmax"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: Optional[RopeSpec]
    qkv_bias: bool = False
    o_bias: bool = False
    # "head": RMSNorm over head_dim (Qwen3); "full": over all heads' width (OLMoE)
    qk_norm: Literal["none", "head", "full"] = "none"
    sliding_window: Optional[int] = None
    sinks: bool = False  # gpt-oss learned per-head sink logit
    output_gate: bool = False  # Qwen3-Next: q_proj also emits a sigmoid gate for the output
    scale: Optional[float] = None  # None: head_dim ** -0.5


class DSAIndexer(_Spec):
    num_heads: int
    head_dim: int
    topk: int


class MLAAttention(_Spec):
    kind: Literal["mla"] = "mla"
    num_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: Optional[RopeSpec]
    indexer: Optional[DSAIndexer] = None  # DeepSeek sparse attention on top of MLA
    scale: Optional[float] = None
    # Kimi K3 (mla_use_output_gate): the attention output times sigmoid(g_proj(x)) [H * V] before o_proj
    output_gate: bool = False
    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("output_gate",)


class GatedDeltaAttention(_Spec):
    """Qwen3-Next style gated delta net: scalar decay per value head, fused in-projections."""
    kind: Literal["gated_delta"] = "gated_delta"
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int
    fused_projections: Literal["qkvz_ba", "qkv_z_b_a"]  # Qwen3-Next vs Qwen3.5 tensor layout
    decay: str = "softplus"  # log-decay form: -exp(A_log) softplus(a + dt_bias); another name is a generated op


class KDAAttention(_Spec):
    """Kimi delta attention: per-channel decay through a low-rank forget gate."""
    kind: Literal["kda"] = "kda"
    num_heads: int
    head_dim: int
    conv_kernel_size: int
    separate_convs: bool = True  # q/k/v_conv1d (Kimi Linear) vs one fused conv1d
    output_gate_activation: Literal["sigmoid", "silu"] = "sigmoid"  # Kimi's gated output norm uses sigmoid
    # Kimi K3 (use_full_rank_gate): the output gate is one g_proj [H * K, D], not Kimi Linear's g_a_proj / g_b_proj
    full_rank_gate: bool = False
    # Kimi K3 (gate_lower_bound, e.g. -5): log decay lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), bounded to
    # (lower_bound, 0); None: Kimi Linear's -exp(A_log) * softplus(f + dt_bias)
    gate_lower_bound: Optional[float] = None
    # A_log stored flat with this many entries, the heads' first and the rest zero padding (Kimi K3: the head width,
    # 128 for 96 heads); None: Kimi Linear's [1, 1, H, 1]
    a_log_width: Optional[int] = None
    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("full_rank_gate", "gate_lower_bound", "a_log_width")


class LightningAttention(_Spec):
    """MiniMax lightning attention: linear attention with a fixed per-head exponential decay."""
    kind: Literal["lightning"] = "lightning"
    num_heads: int
    head_dim: int
    block_size: int


class OwnModule(_Spec):
    """A component no registry op is known to compute: it runs through the model's own (transformers)
    module, with the release's tensors under it (released name -> shape) loaded by name."""
    kind: Literal["own_module"] = "own_module"
    reason: str
    path: str = ""  # the module's attribute path in transformers' decoder layer ("" for the layer itself)
    tensors: dict[str, list[int]] = {}
    # released name -> its name inside the module, after transformers' checkpoint renamings (absent: the same)
    inner: dict[str, str] = {}
    # released modules (`<module>.weight` released) that transformers builds as nn.Linear inside an attention
    # module: the default LoRA targets
    linears: list[str] = []
    # released tensors transformers' conversion splits or fuses on loading (a fused query_key_value): no one
    # module holds them, so they take no LoRA and a merge copies them as released
    reshaped: list[str] = []


Attention = Annotated[
    Union[SoftmaxAttention, MLAAttention, GatedDeltaAttention, KDAAttention, LightningAttention, OwnModule],
    Field(discriminator="kind"),
]


class DenseFFN(_Spec):
    kind: Literal["dense"] = "dense"
    intermediate_size: int
    activation: str = "silu"
    bias: bool = False
    # activation "situ" (Kimi K3's SiTU-GLU): the gate's tanh cap (activation_situ_beta) and the up projection's
    # (activation_situ_linear_beta; None: up not capped)
    situ_beta: Optional[float] = None
    situ_linear_beta: Optional[float] = None
    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("situ_beta", "situ_linear_beta")

    @property
    def situ_betas(self) -> Optional[tuple[float, Optional[float]]]:
        """(beta, linear_beta) as the ops take them, for activation "situ"; None otherwise."""
        return _situ_betas(self)


class RouterSpec(_Spec):
    # what the config names (scoring_func); the registry covers softmax and sigmoid, anything else is a gap
    scoring: str
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # bias steering selection only (DeepSeek noaux_tc, Ernie)
    num_groups: int = 1
    topk_groups: int = 1
    topk_before_softmax: bool = False  # Mixtral / gpt-oss: softmax over the chosen k logits
    bias: bool = False  # router linear has a bias (gpt-oss)
    norm_min: Optional[float] = None  # Ernie: clamp on the renormalization denominator
    aux_loss_coef: Optional[float] = None  # training only: the config's router_aux_loss_coef (runtime/train/balance.py)


class MoEFFN(_Spec):
    kind: Literal["moe"] = "moe"
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    router: RouterSpec
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # total width of the shared expert MLP
    shared_expert_gate: bool = False  # Qwen: sigmoid(x . w) scales the shared expert
    activation: str = "silu"
    expert_bias: bool = False
    swiglu_limit: Optional[float] = None  # gpt-oss clamp
    swiglu_alpha: Optional[float] = None
    interleaved_gate_up: bool = False
    situ_beta: Optional[float] = None  # activation "situ": as DenseFFN's (experts and shared experts alike)
    situ_linear_beta: Optional[float] = None
    # Kimi K3's latent MoE (routed_expert_hidden_size): the routed experts run at this width, between a shared
    # down-projection D -> latent and an up-projection latent -> D (RMSNorm'd in the latent space first with
    # latent_norm, latent_moe_use_norm); the router and the shared experts read x at full width
    latent_size: Optional[int] = None
    latent_norm: bool = False
    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("situ_beta", "situ_linear_beta", "latent_size", "latent_norm")

    @property
    def situ_betas(self) -> Optional[tuple[float, Optional[float]]]:
        return _situ_betas(self)


def _situ_betas(ffn) -> Optional[tuple[float, Optional[float]]]:
    if ffn.activation != "situ" or ffn.situ_beta is None:
        return None
    return ffn.situ_beta, ffn.situ_linear_beta


FFN = Annotated[Union[DenseFFN, MoEFFN, OwnModule], Field(discriminator="kind")]


class NormSpec(_Spec):
    # "rms"; "rms_1p": weight stored as w, applied as (1 + w); "layer": LayerNorm (the registry has no op for
    # it: a gap); another name: a norm the package generated (runtime/ops/norm/torch_form.py), as for decay and mixing
    kind: str
    eps: float

    @property
    def offset(self) -> float:
        """What the stored weight is offset by when applied: (offset + w)."""
        return 1.0 if self.kind == "rms_1p" else 0.0


class ResidualSpec(_Spec):
    """h = skip * alpha + sublayer * beta, skip being the block input (pre-norm) or its normed form (MiniMax)."""
    skip_from_normed: bool = False
    attn_alpha: float = 1.0
    attn_beta: float = 1.0
    ffn_alpha: float = 1.0
    ffn_beta: float = 1.0
    mixing: str = "weighted_sum"  # skip * alpha + sublayer * beta; another name is a generated op


class AttnResSpec(_Spec):
    """Block attention residuals (Kimi's Attention Residuals, arXiv 2603.15031; Kimi K3): each sublayer's input, and
    the final norm's, is a softmax mix over the completed blocks' sums and the current block's partial sum
    (runtime/ops/attn_res), scored by a learned query [D] per sublayer against the sources RMSNorm'd by a norm of its
    own; the embedding is the first block. block_size counts sublayers (attention and FFN alike), as Kimi K3's
    modeling code reads attn_res_block_size: a block spans block_size / 2 layers."""
    block_size: int = Field(ge=2)


class LayerSpec(_Spec):
    index: int
    attention: Attention
    ffn: FFN
    residual: ResidualSpec = ResidualSpec()
    # set when the layer itself (norms, residual wiring) is not understood: the whole decoder layer
    # runs through the model's own module; attention and ffn are then OwnModule too
    own_layer: Optional[str] = None


class VisionSpec(_Spec):
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    out_hidden_size: int
    num_params: int
    model_type: Optional[str] = None  # the vision config's model_type, to rebuild the tower
    spatial_merge_size: int = 2
    image_token_id: Optional[int] = None


class Unrecognized(_Spec):
    source: str  # "config.json:text_config.foo", "weights:model.layers.N.mlp.foo", "auto_map:..."
    item: str
    detail: str = ""
    # filled by the onboarding graph (agents/explain.py): who can explain it, and the validated or refused answer
    needs: Optional[Literal["llm", "person"]] = None
    explanation: Optional[dict] = None


class ParamCounts(_Spec):
    total: int
    active: int  # per token: everything but the routed experts, plus top_k of them per MoE layer
    embedding: int
    attention: int
    ffn_dense: int
    experts_routed: int
    experts_shared: int
    router: int
    norms: int
    vision: int
    buffers: int = 0  # non-parameter tensors the release stores (MiniMax decay tables)


class StoredGroup(_Spec):
    """One tensor group of a release that ships quantized weights (a ParamCounts category), as stored: the formats
    its tensors ship in ("MXFP4 (gpt-oss blocks)", "bfloat16", ...), its parameters counted from logical shapes,
    and the bytes it stores (codes and scales, or the dtype's bytes for a tensor kept unquantized)."""
    formats: list[str]
    params: int
    bytes: int


class ModelSpec(_Spec):
    family: str  # config model_type
    architecture: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    layers: list[LayerSpec]
    norm: NormSpec
    tie_word_embeddings: bool
    # logits = c * tanh(z / c) after the LM head (config final_logit_softcapping); None: plain logits
    final_logit_softcapping: Optional[float] = None
    naming: WeightNaming  # how the release names its tensors
    vision: Optional[VisionSpec] = None
    dtype: str = "bfloat16"
    params: ParamCounts
    unrecognized: list[Unrecognized] = []
    # why the whole model runs as transformers' own (a tensor outside the layers not understood); then
    # every layer is an own layer too, and the runtime runs transformers' text model end to end
    own_model: Optional[str] = None
    # the release's quantization_config as read (onboard/release/quantization.py): its base weights stay in this
    # format; None for a release that ships bf16/fp32. The weight map's `stored` steps say which tensors it covers.
    stored_format: Optional[StoredFormat] = None
    # the same release per tensor group (ParamCounts category -> StoredGroup): the gap report names the formats and
    # the memory budget and plan count these bytes; None when the release is not quantized
    stored_groups: Optional[dict[str, StoredGroup]] = None
    # Kimi K3's block attention residuals in place of the plain residual stream; None: the layers' ResidualSpec
    attn_res: Optional[AttnResSpec] = None
    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("attn_res",)

    def layer_kinds(self) -> list[str]:
        return [layer_kind_name(layer) for layer in self.layers]

    def spec_hash(self) -> str:
        # the stored-format fields join the hash only when set, so a bf16 release's hash is what it was before them
        unset = {name for name in ("stored_format", "stored_groups") if getattr(self, name) is None}
        return hashlib.sha256(self.model_dump_json(exclude=unset or None).encode()).hexdigest()[:16]


def own_tensors(part) -> dict[str, list[int]]:
    """Released name -> shape of an attention / FFN part that runs as its own module ({} otherwise)."""
    return part.tensors if part.kind == "own_module" else {}


def layer_kind_name(layer: LayerSpec) -> str:
    """A short label: 'gated_delta+moe', 'mla_dsa+dense', 'own_layer', ..."""
    if layer.own_layer:
        return "own_layer"
    attn = layer.attention.kind
    if attn == "mla" and layer.attention.indexer is not None:
        attn = "mla_dsa"
    if attn == "softmax" and layer.attention.sliding_window:
        attn = "softmax_window"
    return f"{attn}+{layer.ffn.kind}"


class SpecError(ValueError):
    """spec.json does not have the shape of a ModelSpec (the CLI reports it as bad input, exit 2)."""


def read_spec(data, source: str = "spec.json") -> ModelSpec:
    """spec.json's data as a ModelSpec. Validated strictly, as JSON types are: "8" is not 8 and 1 is not true
    (an integer is a number). A malformed spec raises one SpecError naming `source` and the key path of its
    first problem, e.g. "spec.json: layers[3].attention.num_heads: missing"."""
    try:
        return ModelSpec.model_validate(data, strict=True)
    except ValidationError as error:
        raise SpecError(f"{source}: {_problem(error.errors()[0], data)}") from None


EXPECTED = {"int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
            "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
            "bool_parsing": "true or false", "string_type": "a string", "dict_type": "an object",
            "model_type": "an object", "model_attributes_type": "an object", "list_type": "a list"}
JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "object"}


def _problem(error: dict, data) -> str:
    """'key.path: what is wrong' for one of pydantic's errors."""
    path, kind = _key_path(error["loc"], data), error["type"]
    if kind == "union_tag_invalid":
        path = f"{path}.kind".lstrip(".")
        tags = [tag.strip().strip("'") for tag in error["ctx"]["expected_tags"].split(",")]
        problem = f"expected one of {tags}, got {error['ctx']['tag']!r}"
    elif kind == "union_tag_not_found":
        path, problem = f"{path}.kind".lstrip("."), "missing"
    elif kind == "missing":
        problem = "missing"
    elif kind == "extra_forbidden":
        problem = "not a key of the spec"
    elif kind == "literal_error":
        problem = f"expected one of {_choices(error['ctx']['expected'])}, got {error['input']!r}"
    elif kind in EXPECTED:
        problem = f"expected {EXPECTED[kind]}, got {_json_value(error['input'])}"
    else:
        problem = error["msg"][0].lower() + error["msg"][1:]
    return f"{path}: {problem}" if path else problem


def _key_path(loc: tuple, data) -> str:
    """pydantic's location as a key path into the data: 'layers[3].attention.num_heads'. The location also
    names the member a discriminated union chose (layers.3.attention.softmax.num_heads), which is no key of
    the data: a part equal to the `kind` of the object it would index is left out."""
    path, node = "", data
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            node = node[part] if isinstance(node, list) and 0 <= part < len(node) else None
        elif isinstance(node, dict) and part not in node and node.get("kind") == part:
            continue
        else:
            path = f"{path}.{part}" if path else str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return path


def _choices(expected: str) -> list:
    """pydantic's "'a' or 'b'" of a Literal, as the list ['a', 'b']."""
    return [choice.strip().strip("'") for choice in expected.replace(" or ", ",").split(",")]


def _json_value(value) -> str:
    return "null" if value is None else f"{JSON_TYPES.get(type(value), type(value).__name__)} {value!r}"
