"""LoRA: the dense wrapper against its formula, routed-expert factors through the grouped path against a
per-expert loop, merge/unmerge, state dicts and seeded initialization, on runtime models of tiny releases."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from onboard.align.reference import load_runtime
from onboard.package.reader import read_package
from runtime.model.layers.ffn import Experts
from runtime.model.layers.lora_linear import LoraLinear, weight_of
from runtime.ops.common.backend import force
from runtime.lora.factors import (LoraConfig, apply_lora, load_lora_state_dict, lora_parameters, lora_state_dict, merge_lora,
                          unmerge_lora)
from runtime.ops.moe.torch_form import glu
from runtime.tolerances import assert_close

ATTENTION = ("layers.*.attn.*",)


def _model(example_package, family: str):
    p = read_package(example_package(family))
    return load_runtime(p.spec, p.weight_map, p.source, torch.float32), p.spec


def _randomize(params, seed: int) -> None:
    """Nonzero B (LoRA starts at B = 0, which would hide any mistake in the B path)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def test_dense_lora_matches_its_formula():
    torch.manual_seed(0)
    base = nn.Linear(24, 40, bias=True)
    layer = LoraLinear(base, rank=4, scale=2.0, dropout=0.0)
    _randomize([layer.lora_A, layer.lora_B], 1)
    x = torch.randn(3, 5, 24, requires_grad=True)
    out = layer(x)
    x64, W, b, A, B = (t.detach().double().requires_grad_(True) for t in (x, base.weight, base.bias, layer.lora_A, layer.lora_B))
    ref = x64 @ W.T + b + 2.0 * (x64 @ A.T) @ B.T
    cot = torch.randn(out.shape, dtype=torch.float64)
    (out.double() * cot).sum().backward()
    (ref * cot).sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    for ours, theirs in ((x.grad, x64.grad), (layer.lora_A.grad, A.grad), (layer.lora_B.grad, B.grad)):
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-6)
    assert layer.weight is base.weight


def test_bf16_lora_keeps_fp32_masters_within_bf16_tolerance():
    """On a bf16 base the LoRA GEMMs run in bf16; the factors and their gradients stay fp32."""
    torch.manual_seed(0)
    base = nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    layer = LoraLinear(base, rank=8, scale=2.0, dropout=0.0)
    _randomize([layer.lora_A, layer.lora_B], 2)
    x = torch.randn(2, 7, 64).to(torch.bfloat16).requires_grad_()
    out = layer(x)
    x64, W, A, B = (t.detach().double().requires_grad_(True) for t in (x, base.weight, layer.lora_A, layer.lora_B))
    ref = x64 @ W.T + 2.0 * (x64 @ A.T) @ B.T
    cot = torch.randn(out.shape, dtype=torch.float64)
    out.backward(cot.to(out.dtype))
    (ref * cot).sum().backward()
    assert out.dtype == torch.bfloat16 and layer.lora_A.grad.dtype == layer.lora_B.grad.dtype == torch.float32
    assert_close(out, ref, "lora_linear", torch.bfloat16)
    for name, ours, theirs in (("x", x.grad, x64.grad), ("A", layer.lora_A.grad, A.grad), ("B", layer.lora_B.grad, B.grad)):
        assert_close(ours, theirs, "lora_linear", torch.bfloat16, "grad", name)


def test_rslora_scale_and_dropout_where_a_layer_reads_the_weight():
    assert LoraConfig(rank=4, alpha=8).scale == 2.0 and LoraConfig(rank=4, alpha=8, use_rslora=True).scale == 4.0
    layer = LoraLinear(nn.Linear(8, 8), rank=2, scale=1.0, dropout=0.1)
    with pytest.raises(ValueError, match="dropout"):
        weight_of(layer)
    layer.eval()
    torch.testing.assert_close(weight_of(layer), layer.weight + layer.delta_weight())


def test_apply_lora_freezes_the_base_and_starts_at_it(example_package):
    model, spec = _model(example_package, "qwen3_moe")
    ids = torch.randint(0, spec["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids)
    adapted = apply_lora(model, LoraConfig(rank=4, alpha=8, targets=ATTENTION, experts=True))
    assert adapted == [f"layers.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")] \
        + ["layers.0.ffn.experts", "layers.1.ffn.experts"]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(model)) and len(trainable) == 8 * 2 + 2 * 4
    assert all(p.dtype == torch.float32 for p in lora_parameters(model))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), before, rtol=0, atol=0)


def _expert_loop(x_TD, weights_Tk, idx_Tk, experts: Experts):
    """Plain per-expert reference of the routed experts with LoRA on both projections."""
    s = experts.lora_scale
    y_TD = torch.zeros_like(x_TD)
    for e in range(experts.w_gate_up.shape[0]):
        tokens, slot = (idx_Tk == e).nonzero(as_tuple=True)
        x = x_TD[tokens]
        gate_up = x @ experts.w_gate_up[e].T + s * (x @ experts.lora_gate_up_A[e].T) @ experts.lora_gate_up_B[e].T
        h = glu(*gate_up.chunk(2, dim=-1), "silu", None, None)
        out = h @ experts.w_down[e].T + s * (h @ experts.lora_down_A[e].T) @ experts.lora_down_B[e].T
        y_TD = y_TD.index_add(0, tokens, out * weights_Tk[tokens, slot, None])
    return y_TD


def test_expert_lora_grouped_matches_a_per_expert_loop(example_package):
    model, spec = _model(example_package, "qwen3_moe")
    apply_lora(model, LoraConfig(rank=4, alpha=8, experts=True))
    experts = model.layers[0].ffn.experts
    factors = [experts.lora_gate_up_A, experts.lora_gate_up_B, experts.lora_down_A, experts.lora_down_B]
    _randomize(factors[1::2], 2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, spec["hidden_size"], generator=gen)
    weights_Tk, idx_Tk = model.layers[0].ffn.router(x)
    grads = []
    for run in (lambda: experts(x, weights_Tk, idx_Tk), lambda: _expert_loop(x, weights_Tk, idx_Tk, experts)):
        with force("torch"):
            out = run()
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        grads.append((out.detach(), *(f.grad.clone() for f in factors)))
        for f in factors:
            f.grad = None
    for ours, ref in zip(*grads):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v32"])
def test_merge_equals_adapter_and_unmerge_restores_the_base(example_package, family):
    model, spec = _model(example_package, family)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_lora(model, LoraConfig(rank=4, alpha=8, targets=("layers.*",), experts=True, router=True))
    _randomize(lora_parameters(model), 4)
    ids = torch.randint(0, spec["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        adapter = model(ids)
        merge_lora(model)
        merged = model(ids)
        unmerge_lora(model)
    torch.testing.assert_close(merged, adapter, rtol=1e-5, atol=1e-5)
    changed = [n for n, p in model.named_parameters() if n in base and not torch.equal(p, base[n])]
    assert changed, "merge/unmerge touched no base weight"
    for name in changed:
        torch.testing.assert_close(model.get_parameter(name), base[name], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="already unmerged"):
        unmerge_lora(model)


def test_state_dict_round_trip_and_seeded_init(example_package):
    config = LoraConfig(rank=4, alpha=8, targets=ATTENTION, experts=True, seed=7)
    first, _ = _model(example_package, "qwen3_moe")
    second, _ = _model(example_package, "qwen3_moe")
    apply_lora(first, config)
    # a narrower target set draws the same A for the modules both adapt
    apply_lora(second, LoraConfig(rank=4, alpha=8, targets=("layers.1.attn.q_proj",), seed=7))
    torch.testing.assert_close(second.layers[1].attn.q_proj.lora_A, first.layers[1].attn.q_proj.lora_A, rtol=0, atol=0)
    assert not torch.equal(first.layers[0].attn.q_proj.lora_A, first.layers[1].attn.q_proj.lora_A)
    _randomize(lora_parameters(first), 6)
    third, _ = _model(example_package, "qwen3_moe")
    apply_lora(third, config)
    load_lora_state_dict(third, lora_state_dict(first))
    for name, value in lora_state_dict(first).items():
        assert torch.equal(lora_state_dict(third)[name], value)
    with pytest.raises(KeyError, match="missing"):
        load_lora_state_dict(second, lora_state_dict(first))
