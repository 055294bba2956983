"""The stored-weight forms against decoding with reference_ops/formats.py and then the reference op in fp64: the
linear (with and without LoRA), the routed experts, weight_of, and saved decoded weights kept as recipes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from reference_ops.moe import swiglu_experts
from runtime.formats import codec
from runtime.formats.linear import StoredLinear, stored_linear
from runtime.formats.saved import redecoding
from runtime.formats.scheme import FP8Block, MXFP4
from runtime.formats.weight import StoredWeight
from runtime.model.layers.ffn import Experts
from runtime.model.layers.lora_linear import LoraLinear, weight_of
from runtime.spec import MoEFFN, RouterSpec
from runtime.tolerances import assert_close
from tests.runtime.formats.stored_release import decoded

# FP8 blocks that leave a partial last block both ways (40 = 16 + 16 + 8 rows, 56 = 24 + 24 + 8 columns)
FORMATS = {"fp8": FP8Block(block=(16, 24)), "fp8_pow2": FP8Block(block=(16, 24), power_of_two=True),
           "mxfp4": MXFP4(layout="packed")}
SHAPES = {"fp8": (40, 56), "fp8_pow2": (40, 56), "mxfp4": (40, 64)}


def _filled(fmt, shape, seed: int, dtype=torch.float64) -> StoredWeight:
    """A StoredWeight holding the codec's encoding of a random weight."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.3
    holder = StoredWeight(fmt, shape, dtype)
    if isinstance(fmt, FP8Block):
        codes, scale = codec.fp8_block_encode(w, fmt.block, fmt.power_of_two)
        codes, scale = codes.view(torch.uint8), scale.view(torch.int32)
    else:
        codes, scale = codec.mxfp4_encode(w)
    with torch.no_grad():
        holder.codes.copy_(codes)
        holder.scale.copy_(scale)
    return holder


def _inputs(shape, seed=1, rows=7):
    return torch.randn(rows, shape[-1], dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).requires_grad_()


@pytest.mark.parametrize("kind", FORMATS)
def test_stored_linear_matches_reference_decode_fp64(kind):
    """Forward and input gradient (and a bias's) equal F.linear over the fp64 reference decode: decoding is exact."""
    holder = _filled(FORMATS[kind], SHAPES[kind], 0)
    bias = torch.randn(SHAPES[kind][0], dtype=torch.float64, requires_grad=True)
    x = _inputs(SHAPES[kind])
    y = stored_linear(x, holder, bias)
    dy = torch.randn_like(y)
    dx, db = torch.autograd.grad(y, (x, bias), dy)
    x_ref = x.detach().clone().requires_grad_()
    bias_ref = bias.detach().clone().requires_grad_()
    y_ref = F.linear(x_ref, decoded(holder), bias_ref)
    dx_ref, db_ref = torch.autograd.grad(y_ref, (x_ref, bias_ref), dy)
    assert_close(y, y_ref, "linear", torch.float64)
    assert_close(dx, dx_ref, "linear", torch.float64, "grad")
    assert_close(db, db_ref, "linear", torch.float64, "grad")


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_stored_linear_bf16_is_the_bf16_linear_of_the_decoded_weight(kind):
    """In bf16 the stored linear is bit for bit nn.Linear holding the codec's bf16 decode, forward and backward."""
    holder = _filled(FORMATS[kind], SHAPES[kind], 0, torch.bfloat16)
    plain = nn.Linear(SHAPES[kind][1], SHAPES[kind][0], bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        plain.weight.copy_(holder.decode(torch.bfloat16))
    plain.weight.requires_grad_(False)
    x = _inputs(SHAPES[kind]).to(torch.bfloat16).detach().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = stored_linear(x, holder), plain(x_ref)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad)


def _lora_pair(kind):
    holder = _filled(FORMATS[kind], SHAPES[kind], 0)
    base = nn.Linear(SHAPES[kind][1], SHAPES[kind][0], bias=False, dtype=torch.float64)
    stored = StoredLinear(base, FORMATS[kind])
    stored.weight = holder
    with torch.no_grad():
        base.weight.copy_(decoded(holder))
    base.weight.requires_grad_(False)
    pair = LoraLinear(stored, 4, 2.0, 0.0), LoraLinear(base, 4, 2.0, 0.0)
    g = torch.Generator().manual_seed(3)
    for p in pair:
        with torch.no_grad():
            p.lora_A.copy_(torch.randn(p.lora_A.shape, generator=torch.Generator().manual_seed(4)))
            p.lora_B.copy_(torch.randn(p.lora_B.shape, generator=g.manual_seed(5)))
    return pair


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_lora_over_stored_base(kind):
    """LoraLinear over a StoredLinear: output, input and factor gradients equal LoRA over the fp64-decoded base;
    weight_of gives the decoded weight plus the delta."""
    ours, ref = _lora_pair(kind)
    x, x_ref = _inputs(SHAPES[kind]), _inputs(SHAPES[kind])
    y, y_ref = ours(x), ref(x_ref)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, ours.lora_A, ours.lora_B), dy)
    want = torch.autograd.grad(y_ref, (x_ref, ref.lora_A, ref.lora_B), dy)
    assert_close(y, y_ref, "linear", torch.float64)
    for g, w, name in zip(got, want, ("x", "A", "B")):
        assert_close(g, w, "linear", torch.float64, "grad", name)
    assert_close(weight_of(ours), weight_of(ref), "linear", torch.float64)


def _moe_config() -> MoEFFN:
    return MoEFFN(num_experts=4, top_k=2, expert_intermediate_size=32, router=RouterSpec(scoring="softmax", norm_topk_prob=True))


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_stored_experts_match_reference_op(kind):
    """Experts with stored w_gate_up / w_down and LoRA: output, input, routing-weight and LoRA gradients vs
    reference_ops' swiglu_experts over the fp64 reference decode."""
    fmt = FP8Block(block=(16, 24)) if kind == "fp8" else MXFP4(layout="blocks")
    experts = Experts(_moe_config(), 64).double()
    for leaf, seed in (("w_gate_up", 1), ("w_down", 2)):
        shape = tuple(getattr(experts, leaf).shape)
        delattr(experts, leaf)
        setattr(experts, leaf, _filled(fmt, shape, seed))
    g = torch.Generator().manual_seed(6)
    shapes = {"lora_gate_up_A": (4, 3, 64), "lora_gate_up_B": (4, 64, 3), "lora_down_A": (4, 3, 32), "lora_down_B": (4, 64, 3)}
    for name, shape in shapes.items():
        setattr(experts, name, nn.Parameter(torch.randn(shape, generator=g, dtype=torch.float32) * 0.2))
    experts.lora_scale = 1.5
    x = _inputs((64,), rows=9)
    weights = torch.rand(9, 2, dtype=torch.float64, generator=g).requires_grad_()
    idx = torch.randint(0, 4, (9, 2), generator=g)
    with redecoding():
        y = experts(x, weights, idx)
    factors = [getattr(experts, n) for n in shapes]
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, weights, *factors], dy)
    x_ref, w_ref = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    ref_factors = [f.detach().double().requires_grad_() for f in factors]
    y_ref = swiglu_experts(x_ref, w_ref, idx, decoded(experts.w_gate_up), decoded(experts.w_down),
                           lora_gate_up=tuple(ref_factors[:2]), lora_down=tuple(ref_factors[2:]), lora_scale=1.5)
    want = torch.autograd.grad(y_ref, [x_ref, w_ref, *ref_factors], dy)
    assert_close(y, y_ref, "moe_experts", torch.float64)
    # the factors are fp32 parameters: their gradients are rounded to fp32
    for g_, w_, name in zip(got, want, ["x", "weights", *shapes]):
        assert_close(g_, w_, "moe_experts", g_.dtype, "grad", name)


def test_saved_decoded_weight_is_a_recipe():
    """Inside redecoding(), an op saving a decoded weight (or a view of it) keeps a recipe: the hooks outside see only
    the input, and the gradient is the one computed from the tensor."""
    holder = _filled(FORMATS["fp8"], SHAPES["fp8"], 0)
    seen = []
    x = _inputs(SHAPES["fp8"])
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        with redecoding():
            from runtime.formats.linear import decoded_for_op
            w = decoded_for_op(holder).requires_grad_()
            y = (x * 2) @ w.t()
    assert not any(t.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() for t in seen)
    dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    assert_close(dx, 2 * torch.ones_like(y) @ decoded(holder), "linear", torch.float64, "grad")
    assert_close(dw, torch.ones_like(y).t() @ (2 * x.detach()), "linear", torch.float64, "grad")


def test_model_casts_keep_stored_bits():
    """.to(bf16) / .double() leave codes and scales untouched and move the decode dtype, as a Linear's weight moves."""
    holder = _filled(FORMATS["fp8"], SHAPES["fp8"], 0, torch.float32)
    codes, scale = holder.codes.clone(), holder.scale.clone()
    holder.to(torch.bfloat16)
    assert holder.dtype == torch.bfloat16 and holder.decode().dtype == torch.bfloat16
    holder.double()
    assert holder.dtype == torch.float64
    assert torch.equal(holder.codes, codes) and torch.equal(holder.scale, scale)
