"""onboard/gap/budget.py's activation terms against what the runtime model keeps for backward (runtime/train/saved_bytes.py),
so the memory model cannot drift from the runtime: the qwen3_next example at odd widths (D=80, r=6, 8 experts top-3,
expert width 24, shared 40, all distinct), bf16 through the fused kernels under TRITON_INTERPRET=1 (their values
are not used: only what they keep), per token as the difference of T=128 and T=64 (per-sequence tensors cancel),
policy none and full recompute, each layer part against its term.
"""
import dataclasses
import json

import pytest
import torch

from onboard.gap import budget as memory
from runtime.lora.factors import apply_lora
from runtime.lora.plan import read_lora_yaml
from runtime.memory import MemoryPolicy, apply_memory_policy
from runtime.model.decoder import HybridDecoder
from runtime.ops.common.backend import force
from runtime.spec import ModelSpec
from runtime.train.saved_bytes import counting

pytestmark = pytest.mark.interpreter
RANK, B = 6, 2
RECOMPUTE = MemoryPolicy(recompute=("attention", "linear_attention", "moe", "mlp"))


@pytest.fixture(scope="module")
def odd_spec(example_spec):
    spec = {**example_spec("qwen3_next"), "hidden_size": 80}
    spec["layers"] = [{**layer, "ffn": {**layer["ffn"], "num_experts": 8, "top_k": 3, "expert_intermediate_size": 24,
                                        "shared_intermediate_size": 40}} for layer in spec["layers"]]
    return spec


def _per_token(spec: dict, lora, policy: MemoryPolicy) -> dict[str, float]:
    counts = []
    for T in (64, 128):
        torch.manual_seed(0)
        model = HybridDecoder(spec).to(torch.bfloat16)
        apply_lora(model, lora)
        apply_memory_policy(model, policy)
        with force("triton"), counting(model) as counter:
            model.hidden_states(torch.randint(0, spec["vocab_size"], (1, T)))
        counts.append(counter.bytes)
    return {part: (counts[1][part] - counts[0][part]) / 64 for part in counts[1]}


@pytest.mark.parametrize("policy", ["none", "recompute"])
def test_memory_terms_are_what_the_runtime_keeps(odd_spec, example_package, policy):
    weight_map = json.loads((example_package("qwen3_next") / "weight_map.json").read_text())
    lora = dataclasses.replace(read_lora_yaml(example_package("qwen3_next") / "lora.yaml", weight_map), rank=RANK)
    measured = _per_token(odd_spec, lora, RECOMPUTE if policy == "recompute" else MemoryPolicy())
    spec = ModelSpec.model_validate(odd_spec)
    d = spec.hidden_size
    assert measured.pop("other") == 2 * memory._norms(d, 2) * spec.num_layers
    for i, layer in enumerate(spec.layers):
        attn, tiles, ffn = memory._part_bytes(spec, layer, B, RANK)
        if policy == "recompute":
            # a checkpointed part keeps its input; the GDN tiles stay on the checkpointed forward's ctx
            attn, ffn = B * d + tiles, B * d
        else:
            attn += tiles
        # the chunk layout's int64 indices (16 bytes a chunk of 64) are the only per-token bytes not modelled
        layout = 0.25 if tiles else 0
        assert measured[f"{i}.attn"] == attn + layout, (i, layer.attention.kind)
        assert measured[f"{i}.ffn"] == ffn, i
    assert any(memory._part_bytes(spec, layer, B, RANK)[1] for layer in spec.layers), "no GDN layer was checked"
