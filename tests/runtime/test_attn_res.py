"""Block attention residuals (Kimi K3) in the runtime decoder: the stream of block sums and the partial sum, the mix
in front of every sublayer and of the final norm, written out here as Kimi K3's modeling code runs it (same
sublayer modules and mix op), forward and gradients; the weight map places every new tensor."""
from __future__ import annotations

import pytest
import torch

from onboard.package.weight_map import build_weight_map
from runtime.model.decoder import HybridDecoder
from runtime.model.rotary import RotaryCache
from runtime.ops.attn_res.torch_form import attn_res_mix
from runtime.spec import ModelSpec


@pytest.fixture(scope="module")
def spec(example_spec):
    # a deepseek_v3-shaped text model (a dense layer, then MoE layers) with 4-sublayer blocks: a block every 2 layers
    data = example_spec("deepseek_v3")
    # three layers, so that one layer does not start a block
    layers = data["layers"] + [{**data["layers"][-1], "index": len(data["layers"])}]
    return ModelSpec.model_validate({**data, "layers": layers, "num_layers": len(layers),
                                     "attn_res": {"block_size": 4}})


def _mix(module, sources):
    # the op itself is checked against its fp64 twin in tests/ops/attn_res: here the same op, so that what is
    # compared is the stream around it
    return attn_res_mix(tuple(sources), module.query.weight[0], module.norm.weight, module.norm.eps)


def _as_released(model: HybridDecoder, input_ids):
    """The decoder's stream as Kimi K3's modeling code runs it (blocks, partial; a block starts every
    block_size / 2 layers, the embedding the first partial sum), around the runtime's own sublayers."""
    blocks, partial = [], model.embed_tokens(input_ids)
    rotary = RotaryCache(torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], -1))
    for index, layer in enumerate(model.layers):
        h = _mix(layer.attn_mix, blocks + [partial])
        if index % 2 == 0:
            blocks, partial = blocks + [partial], None
        attn = layer.attn(layer.input_layernorm(h), rotary, None)
        partial = attn if partial is None else partial + attn
        h = _mix(layer.ffn_mix, blocks + [partial])
        partial = partial + layer.ffn(layer.post_attention_layernorm(h))
    return model.norm(_mix(model.output_mix, blocks + [partial]))


def test_decoder_runs_the_released_stream(spec):
    torch.manual_seed(0)
    model = HybridDecoder(spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() > 1 else 1.0) + (1.0 if "norm" in name else 0.0))
    assert len(model.layers) >= 3 and [layer.starts_block for layer in model.layers][:3] == [True, False, True]
    ids = torch.randint(0, spec.vocab_size, (2, 11))
    ours = model.hidden_states(ids)
    theirs = _as_released(model, ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    queries = [layer.attn_mix.query.weight for layer in model.layers] + [model.output_mix.query.weight]
    grads = torch.autograd.grad(ours.square().sum(), queries)
    expected = torch.autograd.grad(theirs.square().sum(), queries)
    for i, (got, want) in enumerate(zip(grads, expected)):
        # the first layer's attention mixes the embedding alone: a softmax over one source, no gradient to its query
        assert (got.abs().sum() > 0) == (i > 0), i
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_weight_map_places_the_attention_residual_tensors(spec):
    mapped = build_weight_map(spec)
    entries = mapped.get("tensors", mapped)
    targets = {e["target"] for e in entries.values() if e["target"]}
    mixes = {name for name, _ in HybridDecoder(spec).named_parameters() if "_mix." in name}
    assert mixes and mixes <= targets
    prefix = spec.naming.prefix
    assert entries[f"{prefix}layers.0.self_attention_res_proj.weight"]["target"] == "layers.0.attn_mix.query.weight"
    assert entries[f"{prefix}output_attn_res_norm.weight"]["target"] == "output_mix.norm.weight"
