"""A model whose base the release stores quantized: built from the weight map's stored steps, loaded as codes and
scales, equal to the model of the decoded weights (logits and LoRA gradients in fp64), holding the stored bytes
only, keeping no decoded weight for its backward, refusing NaN scales by name, and training."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.errors import InputFileError
from runtime.formats.weight import StoredWeight, held_bytes
from runtime.lora.factors import LoraConfig, apply_lora, lora_parameters
from runtime.model.stored import build_stored_model, stored_targets
from runtime.model.weights import load_release
from runtime.train.saved_bytes import counting
from runtime.tolerances import assert_close
from tests.runtime.formats.stored_release import fp64_twin

LORA = LoraConfig(rank=4, alpha=8, targets=("layers.*.attn.*", "layers.*.ffn.*"), experts=True)
IDS = torch.randint(3, 250, (1, 24), generator=torch.Generator().manual_seed(0))


def _loaded(stored_package, family, kind, dtype=torch.float64, release=None):
    spec, weight_map, source, _ = stored_package(family, kind)
    model = build_stored_model(spec, stored_targets(weight_map), "cpu", dtype)
    load_release(model, release or source, weight_map)
    return spec, model


def _with_lora(model, config=LORA):
    apply_lora(model, config)
    with torch.no_grad():
        for i, p in enumerate(lora_parameters(model)):
            if p.abs().sum() == 0:  # B starts at zero: give it values so that every factor has a gradient
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
    return model


def _same_lora(model, twin, config=LORA):
    """twin with LoRA applied and the factors of model."""
    apply_lora(twin, config)
    factors = dict(twin.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                factors[name].copy_(p)
    return twin


@pytest.mark.parametrize("family,kind", [("qwen3_moe", "fp8"), ("deepseek_v3", "fp8"), ("qwen3_next", "fp8"),
                                         ("gpt_oss", "mxfp4"), ("qwen3_moe", "mxfp4_packed")])
def test_stored_model_equals_decoded_model(stored_package, family, kind):
    """Logits, loss and every LoRA gradient of the stored model equal those of the model holding the fp64 reference
    decode of the same bits (attention, MLA's fused weights, GDN, shared experts, routed experts)."""
    spec, model = _loaded(stored_package, family, kind)
    twin = _same_lora(_with_lora(model), fp64_twin(model, spec))
    losses, grads = [], []
    for m in (model, twin):
        logits = m(IDS)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], IDS[0, 1:])
        losses.append(loss)
        grads.append(dict(zip([n for n, p in m.named_parameters() if p.requires_grad],
                              torch.autograd.grad(loss, lora_parameters(m)))))
    assert_close(losses[0], losses[1], "linear", torch.float64)
    assert grads[0].keys() == grads[1].keys() and any("experts.lora" in n for n in grads[0])
    for name in grads[1]:
        assert grads[1][name].norm() > 0, name
        assert_close(grads[0][name], grads[1][name], "linear", torch.float32, "grad", name)


@pytest.mark.parametrize("family,kind", [("qwen3_moe", "fp8"), ("gpt_oss", "mxfp4")])
def test_model_holds_the_stored_bytes(stored_package, family, kind):
    """Parameters + buffers of the bf16 model with LoRA = the release's bytes (codes, fp32 scales, bf16 tensors kept
    unquantized) + the LoRA factors: no bf16 copy of a stored weight is held."""
    _, _, source, _ = stored_package(family, kind)
    spec, model = _loaded(stored_package, family, kind, torch.bfloat16)
    apply_lora(model, LORA)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    lora = sum(p.numel() * p.element_size() for p in lora_parameters(model))
    release = load_file(source / "model.safetensors")
    assert held_bytes(model) > 0
    assert held == sum(t.numel() * t.element_size() for t in release.values()) + lora


@pytest.mark.parametrize("family,kind", [("qwen3_moe", "fp8"), ("deepseek_v3", "fp8"), ("gpt_oss", "mxfp4")])
def test_backward_keeps_no_decoded_weight(stored_package, family, kind):
    """What autograd keeps for backward (runtime/train/saved_bytes.py) is the same for the stored model as for the
    model of the decoded weights, whose weights are parameters (never counted): no decoded weight is kept. LoRA on
    the experts only: the twin's LoRA-merged weights that fused ops read (W + BA, not parameters) would count there,
    where the stored model keeps recipes for them too."""
    spec, model = _loaded(stored_package, family, kind, torch.float32)
    experts_only = LoraConfig(rank=4, alpha=8, experts=True)
    twin = _same_lora(_with_lora(model, experts_only), fp64_twin(model, spec).float(), experts_only)
    kept = []
    for m in (model, twin):
        with counting(m) as counter:
            m(IDS).sum().backward()
        kept.append(counter.bytes)
    assert kept[0] == kept[1]


def _tampered(source: Path, out: Path, name: str, edit) -> Path:
    shutil.copytree(source, out)
    tensors = load_file(out / "model.safetensors")
    tensors[name] = edit(tensors[name].clone())
    save_file(tensors, out / "model.safetensors")
    return out


def _nan_fp8_scale(t):
    t.view(-1)[0] = float("nan")
    return t


def _nan_fp8_code(t):
    t.view(torch.uint8).view(-1)[3] = 0x7F
    return t


def _nan_e8m0(t):
    t.view(-1)[1] = 255
    return t


@pytest.mark.parametrize("kind,suffix,edit", [("fp8", "q_proj.weight_scale_inv", _nan_fp8_scale),
                                              ("fp8", "o_proj.weight", _nan_fp8_code),
                                              ("mxfp4", "gate_up_proj_scales", _nan_e8m0)])
def test_nan_scales_and_codes_are_refused_by_name(stored_package, tmp_path, kind, suffix, edit):
    family = "qwen3_moe" if kind == "fp8" else "gpt_oss"
    _, _, source, _ = stored_package(family, kind)
    name = next(n for n in load_file(source / "model.safetensors") if n.endswith(suffix))
    bad = _tampered(source, tmp_path / "bad", name, edit)
    with pytest.raises(InputFileError, match=name.replace(".", r"\.")):
        _loaded(stored_package, family, kind, release=bad)


def test_checkpoint_holds_no_base(stored_package, tmp_path):
    """A training checkpoint of a stored model saves the LoRA factors and optimizer only, no codes or scales."""
    from runtime.train import checkpoint
    from runtime.train.loop import TrainConfig, optimizer_for

    _, model = _loaded(stored_package, "qwen3_moe", "fp8", torch.float32)
    _with_lora(model)
    optimizer = optimizer_for(lora_parameters(model), TrainConfig(), torch.device("cpu"))
    saved = checkpoint.save(tmp_path, model, optimizer, {"step": 1}, keep_last=1)
    files = b"".join(p.read_bytes() for p in Path(saved).rglob("*") if p.is_file())
    assert b"lora_A" in files and b".codes" not in files and b".scale" not in files
    assert any(isinstance(m, StoredWeight) for m in model.modules())


def test_recompute_and_flops_over_stored_weights(stored_package):
    """Recomputing attention and MoE in backward gives the same LoRA gradients on a stored model (the checkpoint's
    hooks sit outside the redecoding ones); the FLOP count of the stored model is that of the decoded one."""
    from runtime.memory import MemoryPolicy, apply_memory_policy
    from runtime.train.flops import projection_flops_per_token

    grads = []
    for policy in (MemoryPolicy(), MemoryPolicy(recompute=("attention", "moe"))):
        spec, model = _loaded(stored_package, "deepseek_v3", "fp8")
        _with_lora(model)
        apply_memory_policy(model, policy)
        loss = model(IDS).logsumexp(-1).mean()
        grads.append(torch.autograd.grad(loss, lora_parameters(model)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    twin = _same_lora(model, fp64_twin(model, spec))
    assert projection_flops_per_token(model) == projection_flops_per_token(twin) > 0


def test_placement_reads_codes_and_scales_once(stored_package):
    """loads_by_rank over a stored weight map: every runtime codes and scale tensor's rows are read exactly once over
    dp2 x ep2, from the released codes and scale tensors."""
    from runtime.model.decoder import HybridDecoder
    from runtime.model.stored import apply_stored
    from runtime.parallel.placement import MeshShape, loads_by_rank, model_targets, moe_layers

    spec, weight_map, source, _ = stored_package("qwen3_moe", "fp8")
    with torch.device("meta"):
        model = HybridDecoder(spec)
    apply_stored(model, stored_targets(weight_map))
    targets = model_targets(model)
    loads = loads_by_rank(weight_map, targets, moe_layers(model.config), MeshShape(2, 2))
    counts = {t: torch.zeros(targets[t][0][0], dtype=torch.int64) for t in targets if t.endswith((".codes", ".scale"))}
    for rank_loads in loads.values():
        for load in rank_loads:
            if load.target in counts:
                counts[load.target][load.rows[0]:load.rows[1]] += 1
    assert counts and any(t.endswith("experts.w_gate_up.scale") for t in counts)
    released = set(load_file(source / "model.safetensors"))
    assert {load.name for rank_loads in loads.values() for load in rank_loads} <= released
    for target, count in counts.items():
        # an expert's gate_up rows come from its gate and its up tensors; every other row from one tensor, once
        assert bool((count == (2 if target.endswith("w_gate_up.codes") or target.endswith("w_gate_up.scale") else 1)).all()), target


def test_stored_weights_the_runtime_cannot_hold_are_a_gap(stored_package):
    """A stored step on a norm weight, or an FP8 row split inside a scale block, is StoredUnsupported (exit 3)."""
    from runtime.errors import StoredUnsupported
    from runtime.formats.entry import stored_parts
    from runtime.formats.scheme import FP8Block

    spec, weight_map, _, _ = stored_package("qwen3_moe", "fp8")
    norm = next(name for name, e in weight_map.items() if (e["target"] or "").endswith("input_layernorm.weight"))
    some_stored = next(e["stored"] for e in weight_map.values() if e.get("stored"))
    with pytest.raises(StoredUnsupported, match="input_layernorm"):
        build_stored_model(spec, stored_targets(weight_map | {norm: weight_map[norm] | {"stored": some_stored}}), "cpu")
    entry = next(e for e in weight_map.values() if e.get("stored") and e["rows"] and e["rows"][0])
    split = entry | {"stored": entry["stored"] | {"format": FP8Block(block=(24, 24)).model_dump(mode="json")}}
    with pytest.raises(StoredUnsupported, match="scale block"):
        stored_parts(split)
