"""Kimi K3's latent MoE: the runtime MoE block with latent_size / latent_norm (a shared down-projection to the latent
width, SiTU experts there through the fused grouped-GEMM path, a latent RMSNorm, the up-projection, shared experts at
full width on x) vs the fp64 twin (reference_ops/moe.py latent_experts + swiglu_mlp), forward and the gradients of x
and every weight; the kernel under TRITON_INTERPRET=1, the torch form everywhere.

Shape legend: T tokens, D model width, L latent width, E experts, F expert width, k top-k.
"""
from __future__ import annotations

import pytest
import torch

from reference_ops import mlp as ref_mlp
from reference_ops import moe as ref
from runtime.model.layers.ffn import MoE
from runtime.ops.common.backend import force
from runtime.spec import MoEFFN, RouterSpec
from runtime.tolerances import assert_close

D, L, E, F_EXPERT, EPS = 48, 24, 6, 16, 1e-6
SITU = dict(activation="situ", situ_beta=1.5, situ_linear_beta=2.0)


def _block(latent_norm: bool) -> MoE:
    config = MoEFFN(num_experts=E, top_k=2, expert_intermediate_size=F_EXPERT, num_shared_experts=1,
                    shared_intermediate_size=2 * F_EXPERT, latent_size=L, latent_norm=latent_norm,
                    router=RouterSpec(scoring="sigmoid", norm_topk_prob=True, correction_bias=True), **SITU)
    torch.manual_seed(3)
    block = MoE(config, D, EPS)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5 + (1.0 if "norm" in name else 0.0))
    return block


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("latent_norm", [True, False], ids=["latent-norm", "no-norm"])
def test_latent_moe_block_matches_reference(latent_norm, backend):
    block = _block(latent_norm)
    assert tuple(block.experts.w_gate_up.shape) == (E, 2 * F_EXPERT, L)
    x = torch.randn(37, D, requires_grad=True)
    weights, idx = (t.detach() for t in block.router(x.detach()))  # the router is checked elsewhere
    with force(backend):
        ours = block.add_shared(x, block.routed(x, weights, idx))
    w = {n: p.detach().double().requires_grad_() for n, p in block.named_parameters()}
    x_ref = x.detach().double().requires_grad_()
    betas = (SITU["situ_beta"], SITU["situ_linear_beta"])
    theirs = ref.latent_experts(x_ref, weights.double(), idx, w["latent_down.weight"], w["latent_up.weight"],
                                w.get("latent_norm.weight"), EPS, w["experts.w_gate_up"], w["experts.w_down"],
                                activation="situ", situ_betas=betas)
    theirs = theirs + ref_mlp.swiglu_mlp(x_ref, w["shared.gate_proj.weight"], w["shared.up_proj.weight"],
                                         w["shared.down_proj.weight"], "situ", situ_betas=betas)
    assert_close(ours, theirs, "swiglu_experts", torch.float32, "out", "latent MoE")
    cot = torch.randn_like(theirs)
    ours.backward(cot.float())
    theirs.backward(cot)
    assert_close(x.grad, x_ref.grad, "swiglu_experts", torch.float32, "grad", "x")
    for name, p in block.named_parameters():
        if name in w and w[name].grad is not None:
            assert_close(p.grad, w[name].grad, "swiglu_experts", torch.float32, "grad", name)
    assert {"latent_down.weight", "latent_up.weight", "experts.w_gate_up"} <= {n for n in w if w[n].grad is not None}


def test_weight_map_places_the_latent_projections(example_spec):
    """The released routed_expert_down_proj / _up_proj / _norm land on the runtime MoE's latent projections, and the
    experts' released shapes are at the latent width."""
    from onboard.package.weight_map import build_weight_map
    from onboard.recognize.weight_layout import expected_tensors
    from runtime.model.decoder import HybridDecoder
    from runtime.spec import ModelSpec

    data = example_spec("deepseek_v3")
    layers = [{**layer, "ffn": {**layer["ffn"], "latent_size": 16, "latent_norm": True}}
              if layer["ffn"]["kind"] == "moe" else layer for layer in data["layers"]]
    spec = ModelSpec.model_validate({**data, "layers": layers})
    mapped = build_weight_map(spec)
    entries = mapped.get("tensors", mapped)
    targets = {e["target"] for e in entries.values() if e["target"]}
    latent = {n for n, _ in HybridDecoder(spec).named_parameters() if ".latent_" in n}
    assert latent and latent <= targets
    moe = next(layer for layer in spec.layers if layer.ffn.kind == "moe")
    base = f"{spec.naming.prefix}layers.{moe.index}.{spec.naming.ffn_module}."
    shapes = expected_tensors(spec)
    assert shapes[base + "routed_expert_down_proj.weight"] == (16, spec.hidden_size)
    assert shapes[base + "experts.0.gate_proj.weight"][1] == 16
