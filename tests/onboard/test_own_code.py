"""What transformers knows but we do not recognize runs through its own code, trainable like the rest:
the whole model (glue outside the layers not understood), or a layer part under transformers' own module
name. Releases are tiny real families of the installed transformers (none of the 12 named ones), built
the way the family sweep builds them."""
from __future__ import annotations

import json

import torch

from onboard.align.package_files import read_package
from onboard.align.report import Check
from onboard.align.reference import load_reference, load_runtime, random_tokens
from onboard.fallback import replan
from onboard.gap import analyze
from onboard.manifest import read_manifest
from onboard.package import write_package
from onboard.recognize import recognize
from runtime.lora import apply_lora
from runtime.lora_file import read_lora_yaml
from runtime.model import causal_lm_loss
from runtime.tolerances import compare, tolerance_for


def _runtime(pkg, dtype=torch.float32):
    inputs = read_package(pkg)
    return inputs, load_runtime(inputs.spec, inputs.weight_map, inputs.source, dtype)


def _logits_match(inputs, model) -> bool:
    ids = random_tokens(inputs.spec, 2, 11, seed=0)
    with torch.no_grad():
        theirs = load_reference(inputs.source, inputs.spec["family"], torch.float32)(input_ids=ids, use_cache=False).logits
        return compare(model(ids), theirs.float(), tolerance_for("model_logits", torch.float32)).passed


def _packed_equals_separate(model, vocab: int) -> bool:
    """Two documents packed in one row (cu_seqlens, positions restarting) give each document's own run."""
    a, b = (torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 7))
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        packed = model.hidden_states(torch.cat([a, b], 1), positions, cu_seqlens=torch.tensor([0, 5, 12]))
        separate = torch.cat([model.hidden_states(a), model.hidden_states(b)], 1)
    return torch.allclose(packed, separate, atol=1e-5, rtol=1e-5)


def _lora_trains(inputs, model, pkg) -> list[str]:
    """The package's LoRA plan on the model, one backward; returns the adapted modules, asserting every
    B factor got a gradient (A's is zero while B starts at zero)."""
    adapted = apply_lora(model, read_lora_yaml(pkg / "lora.yaml", inputs.weight_map))
    ids = random_tokens(inputs.spec, 2, 9, seed=1)
    causal_lm_loss(model(ids), ids).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    return adapted


def test_a_tensor_outside_the_layers_that_transformers_reads_makes_the_whole_model_its_own(tiny_family):
    """Phi-MoE's final norm is a LayerNorm (model.norm.bias): glue we do not assemble, so the whole model is
    transformers' own (own:model, the only op); it reproduces transformers' logits, honours packing, and its
    attention projections take LoRA and get gradients."""
    release, pkg = tiny_family("phimoe")
    manifest = read_manifest(release)
    spec = recognize(manifest)
    assert spec.own_model and "model.norm.bias" in spec.own_model
    report = analyze(spec, manifest)
    assert [(o.op, o.status) for o in report.ops] == [("own:model", "fallback")]
    assert not report.summary["gaps_remain"]
    inputs, model = _runtime(pkg)
    assert _logits_match(inputs, model)
    assert _packed_equals_separate(model, inputs.spec["vocab_size"])
    adapted = _lora_trains(inputs, model, pkg)
    assert adapted and all(name.startswith("own.module.") and ".self_attn." in name for name in adapted)


def test_an_own_module_sits_where_transformers_names_it(tiny_family):
    """MiniMax-M2 releases its MoE under `block_sparse_moe`, which transformers loads as `mlp`: the own FFN's
    path and runtime names are transformers' (after its checkpoint renamings), so it loads and matches."""
    release, pkg = tiny_family("minimax_m2")
    spec = json.loads((pkg / "spec.json").read_text())
    ffns = [layer["ffn"] for layer in spec["layers"] if layer["ffn"]["kind"] == "own_module"]
    assert ffns and all(f["path"] == "mlp" for f in ffns)
    assert any(".block_sparse_moe." in name for f in ffns for name in f["tensors"])
    inputs, model = _runtime(pkg)
    assert _logits_match(inputs, model)


def test_own_attention_honours_packing_and_takes_lora(tiny_family):
    """Laguna's attention and MoE run as own modules: packed documents run one segment at a time through
    transformers' attention, and its q/k/v/o projections (nn.Linear there) are the package's LoRA targets."""
    release, pkg = tiny_family("laguna")
    inputs, model = _runtime(pkg)
    assert any(layer["attention"]["kind"] == "own_module" for layer in inputs.spec["layers"])
    assert _packed_equals_separate(model, inputs.spec["vocab_size"])
    adapted = _lora_trains(inputs, model, pkg)
    assert adapted and all(".attn.module." in name for name in adapted)


def test_the_whole_model_takes_what_its_head_takes(tiny_family, tmp_path):
    """Inkling divides the final hidden states by `logits_mup_width_multiplier` in its causal-LM forward, before
    the head: run as its own model (the fallback's last rung), the head takes what that forward feeds it, so the
    logits are transformers'."""
    release, _ = tiny_family("inkling_text")
    manifest = read_manifest(release)
    assert manifest.config["logits_mup_width_multiplier"] not in (None, 1, 1.0)
    failed = Check(tier=2, name="logits/float32", metric="rel_rms", value=23.0, tolerance=1e-4, verdict="fail")
    spec = replan(recognize(manifest), manifest, "model", [failed])
    pkg, _ = write_package(release, tmp_path / "pkg", spec=spec)
    inputs, model = _runtime(pkg)
    assert _logits_match(inputs, model)


def test_a_final_logit_softcap_caps_the_logits_and_the_training_loss(tiny_family):
    """Inkling-2 caps its logits (c * tanh(z / c), config final_logit_softcapping) after the LM head: the spec
    carries the cap, and the runtime's logits and its chunked training loss apply it as transformers does
    (at this size the uncapped logits miss the fp32 bar)."""
    from runtime.data import IGNORE
    from runtime.train import loss_sum

    release, pkg = tiny_family("inkling2_text")
    inputs, model = _runtime(pkg)
    cap = inputs.spec["final_logit_softcapping"]
    assert cap == json.loads((release / "config.json").read_text())["final_logit_softcapping"]
    assert _logits_match(inputs, model)
    ids = random_tokens(inputs.spec, 1, 13, seed=2)
    with torch.no_grad():
        theirs = load_reference(inputs.source, inputs.spec["family"], torch.float32)(input_ids=ids, use_cache=False).logits
        uncapped = torch.nn.functional.linear(model.hidden_states(ids), model.head_weight())
        batch = {"input_ids": ids, "positions": torch.arange(13)[None], "cu_seqlens": torch.tensor([0, 13]),
                 "labels": torch.cat([ids[0, 1:], torch.tensor([IGNORE])])}
        ours_loss = loss_sum(model, batch, chunk=5) / 12
    tol = tolerance_for("model_logits", torch.float32)
    assert not compare(uncapped, theirs, tol).passed
    loss = compare(ours_loss, causal_lm_loss(theirs, ids), tolerance_for("model_loss", torch.float32))
    assert loss.passed, loss.describe()


def test_the_bf16_check_pins_expert_choices_inside_own_modules(tiny_family):
    """MiniMax-M2's MoE runs as its own module: the bf16 run's experts get the fp32 run's choices where they
    differ (at transformers' experts call), so the bf16 check measures bf16 numerics within the 2e-2 bar."""
    from onboard.align import own_choices
    from onboard.align.tier2_model import tier2

    release, pkg = tiny_family("minimax_m2")
    inputs = read_package(pkg)
    ids, fp32, free, pinned = random_tokens(inputs.spec, 2, 24, seed=1), {}, {}, {}
    for dtype, seen, pin in ((torch.float32, fp32, False), (torch.bfloat16, free, False), (torch.bfloat16, pinned, True)):
        model = _runtime(pkg, dtype)[1]
        hooks = (own_choices.pin(model, fp32) if pin else []) + own_choices.record(model, seen)
        with torch.no_grad():
            model(ids)
        own_choices.remove(hooks)
    same = lambda a, b: torch.equal(a[0].sort(-1).values, b[0].sort(-1).values)  # noqa: E731
    assert fp32 and fp32.keys() == pinned.keys()
    assert not all(same(free[n], fp32[n]) for n in fp32), "no choice flips free: the pin is not exercised"
    assert all(same(pinned[n], fp32[n]) for n in fp32)
    checks = {c.name: c for c in tier2(inputs.spec, inputs.weight_map, inputs.source, inputs.spec["num_layers"])[0]}
    assert checks["logits/bfloat16"].verdict == "pass" and checks["logits/bfloat16"].value <= 2e-2
