"""The memory policy changes memory, not numerics: loss and LoRA gradients with recompute (and, on CPU, the
offload path, a no-op there) equal those without, bit for bit."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from onboard.package.trainer_build import build_model, read_lora
from runtime.lora.factors import lora_parameters
from runtime.memory import MemoryPolicy
from runtime.train.data import Document, pack
from runtime.train.loop import loss_sum, micro_batch

EVERY_KIND = ("attention", "linear_attention", "moe", "mlp")


def _loss_and_grads(package: Path, policy: MemoryPolicy):
    import yaml

    spec = json.loads((package / "spec.json").read_text())
    weight_map = json.loads((package / "weight_map.json").read_text())
    release = Path(yaml.safe_load((package / "package.yaml").read_text())["source"]["absolute"])
    model = build_model(spec, weight_map, release, read_lora(package, weight_map), policy, "cpu")
    for p in lora_parameters(model):
        # B starts at zero, which would leave A's gradient zero: give both factors values
        torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(p.numel()))
    calls = []
    # called inside the wrapped forward: a recomputed layer calls it again in backward
    model.layers[-1].ffn.experts.register_forward_hook(lambda *args: calls.append(1))
    gen = torch.Generator().manual_seed(0)
    docs = [Document(torch.randint(3, 200, (n,), generator=gen).tolist(), [True] * n) for n in (20, 30, 14)]
    loss = loss_sum(model, micro_batch(pack(docs, 32, 0), [0, 1], "cpu"), 16)
    loss.backward()
    return loss.detach(), [p.grad for p in lora_parameters(model)], len(calls)


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v32"])
def test_recompute_and_offload_keep_loss_and_grads(example_package, family):
    package = example_package(family)
    loss, grads, calls = _loss_and_grads(package, MemoryPolicy())
    assert all(g is not None and g.abs().sum() > 0 for g in grads) and calls == 1
    for policy in (MemoryPolicy(recompute=EVERY_KIND), MemoryPolicy(recompute=("moe",), offload=("attention", "mlp"))):
        with pytest.warns(UserWarning, match="no-op") if policy.offload else contextlib.nullcontext():
            other_loss, other_grads, other_calls = _loss_and_grads(package, policy)
        assert other_calls == (2 if "moe" in policy.recompute else 1)
        assert torch.equal(other_loss, loss)
        assert all(torch.equal(a, b) for a, b in zip(other_grads, grads))


def test_unknown_op_kind_is_refused():
    with pytest.raises(ValueError, match="unknown op kinds"):
        MemoryPolicy(recompute=("attn",))
