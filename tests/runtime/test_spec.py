"""runtime/spec.py's read_spec: every family's spec.json reads into the ModelSpec it was written from, strictly
(JSON's types, not Python's coercions); a malformed spec raises one SpecError naming the key path."""
from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from onboard.examples.models import FAMILIES
from runtime.model.decoder import HybridDecoder
from runtime.spec import MLAAttention, ModelSpec, SpecError, read_spec


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_reads_back(family, example_spec):
    spec = example_spec(family)
    model_spec = read_spec(spec)
    assert json.loads(model_spec.model_dump_json()) == spec
    assert [layer.attention.kind for layer in model_spec.layers] == [layer["attention"]["kind"] for layer in spec["layers"]]
    assert [layer.ffn.kind for layer in model_spec.layers] == [layer["ffn"]["kind"] for layer in spec["layers"]]


def test_dict_entry_point_reads_the_same(example_spec):
    spec = example_spec("deepseek_v32")
    with torch.device("meta"):
        from_dict, from_spec = HybridDecoder(spec), HybridDecoder(read_spec(spec))
    assert from_dict.config == from_spec.config
    assert isinstance(from_dict.config, ModelSpec) and isinstance(from_dict.config.layers[0].attention, MLAAttention)
    assert from_dict.config.layers[0].attention.indexer is not None
    shapes = lambda model: {n: t.shape for n, t in model.state_dict().items()}
    assert shapes(from_dict) == shapes(from_spec)


def _set(spec: dict, path: tuple, value) -> dict:
    spec = copy.deepcopy(spec)
    *parents, last = path
    target = spec
    for key in parents:
        target = target[key]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return spec


_DELETE = object()
# qwen3_next: layers 0-2 gated delta + MoE, layer 3 softmax + MoE
MALFORMED = {
    "missing-heads": (("layers", 3, "attention", "num_heads"), _DELETE, "layers[3].attention.num_heads: missing"),
    "missing-router": (("layers", 1, "ffn", "router"), _DELETE, "layers[1].ffn.router: missing"),
    "missing-layers": (("layers",), _DELETE, "layers: missing"),
    "string-for-int": (("layers", 0, "ffn", "num_experts"), "8", "layers[0].ffn.num_experts: expected an integer, got string '8'"),
    "bool-for-int": (("hidden_size",), True, "hidden_size: expected an integer, got boolean True"),
    "null-for-int": (("vocab_size",), None, "vocab_size: expected an integer, got null"),
    "null-for-attention": (("layers", 0, "attention"), None, "layers[0].attention: expected an object, got null"),
    "int-for-bool": (("tie_word_embeddings",), 1, "tie_word_embeddings: expected true or false, got integer 1"),
    "string-for-float": (("norm", "eps"), "1e-6", "norm.eps: expected a number, got string '1e-6'"),
    "unknown-choice": (("layers", 2, "attention", "fused_projections"), "qkv", "layers[2].attention.fused_projections: expected one of ['qkvz_ba', 'qkv_z_b_a'], got 'qkv'"),
    "unknown-kind": (("layers", 0, "attention", "kind"), "mamba", "layers[0].attention.kind: expected one of ['softmax', 'mla'"),
    "missing-kind": (("layers", 0, "ffn", "kind"), _DELETE, "layers[0].ffn.kind: missing"),
    "unknown-key": (("layers", 1, "ffn", "router", "temperature"), 1.0, "layers[1].ffn.router.temperature: not a key of"),
    "float-for-int": (("layers", 2, "attention", "num_v_heads"), 4.0, "layers[2].attention.num_v_heads: expected an integer, got number 4.0"),
    "list-for-object": (("layers", 3, "attention", "rope"), [], "layers[3].attention.rope: expected an object, got list []"),
    "object-for-list": (("layers",), {}, "layers: expected a list, got object {}"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_spec_names_the_key(case, example_spec):
    path, value, message = MALFORMED[case]
    spec = _set(example_spec("qwen3_next"), path, value)
    with pytest.raises(SpecError, match="^" + re.escape(f"pkg/spec.json: {message}")):
        read_spec(spec, source="pkg/spec.json")


def test_spec_that_is_not_an_object():
    with pytest.raises(SpecError, match=re.escape("spec.json: expected an object, got list []")):
        read_spec([])


def test_model_from_a_malformed_dict_raises_spec_error(example_spec):
    spec = _set(example_spec("qwen3_next"), ("layers", 3, "attention", "num_heads"), _DELETE)
    with pytest.raises(SpecError, match=re.escape("spec.json: layers[3].attention.num_heads: missing")):
        HybridDecoder(spec)
    assert issubclass(SpecError, ValueError)
