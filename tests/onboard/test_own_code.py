"""What transformers knows but we do not recognize runs through its own code, trainable like the rest:
the whole model (glue outside the layers not understood), or a layer part under transformers' own module
name. Releases are tiny real families of the installed transformers (none of the 12 named ones), built
the way the family sweep builds them."""
from __future__ import annotations

import json

import torch

from onboard.align.reference import load_reference, load_runtime, random_tokens
from onboard.align.report import Check
from onboard.gap.report import analyze
from onboard.package.reader import read_package
from onboard.package.writer import write_package
from onboard.recognize.recognizer import recognize
from onboard.release.manifest import read_manifest
from onboard.review.demotion import demotion_step
from runtime.lora.factors import apply_lora
from runtime.lora.plan import read_lora_yaml
from runtime.model.decoder import causal_lm_loss
from runtime.spec import read_spec
from runtime.tolerances import compare, tolerance_for


def _runtime(pkg, dtype=torch.float32):
    inputs = read_package(pkg)
    return inputs, load_runtime(inputs.spec, inputs.weight_map, inputs.source, dtype)


def _logits_match(inputs, model) -> bool:
    ids = random_tokens(read_spec(inputs.spec), 2, 11, seed=0)
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
    ids = random_tokens(read_spec(inputs.spec), 2, 9, seed=1)
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
    assert [(o.op, o.status) for o in report.ops] == [("own:model", "own")]
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


def test_an_own_layer_gets_what_its_decoder_passes_it(tiny_family):
    """Beam's decoder passes each layer its layer type's rotary table (or none, for NoPE layers, with an
    attention scaling instead): recorded from the decoder's own forward, each own layer gives what the layer
    gives inside transformers' model, and packed documents still run apart."""
    from runtime.model.rotary import RotaryCache

    release, pkg = tiny_family("beam")
    inputs, model = _runtime(pkg)
    assert all(layer["own_layer"] for layer in inputs.spec["layers"])
    ids = random_tokens(read_spec(inputs.spec), 1, 11, seed=0)
    with torch.no_grad():
        ref = load_reference(inputs.source, inputs.spec["family"], torch.float32)
        hidden = ref(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
        rotary = RotaryCache(torch.arange(11)[None])
        # hidden[i] enters layer i; the last layer's output is only seen after the final norm
        for i in range(len(model.layers) - 1):
            assert torch.allclose(model.layers[i](hidden[i], rotary), hidden[i + 1], atol=1e-6, rtol=1e-5), i
    assert _packed_equals_separate(model, inputs.spec["vocab_size"])


def test_own_layers_load_where_the_config_counts_decoder_layers_apart(tiny_family):
    """LongCat-Flash derives num_hidden_layers (two attention sublayers per decoder layer) from num_layers:
    the own layers are cut by the stored count, so every decoder layer is there and the logits match. Its
    attention class is named *MLA: found as the innermost module taking the mask, its projections take LoRA."""
    release, pkg = tiny_family("longcat_flash")
    inputs, model = _runtime(pkg)
    assert len(inputs.spec["layers"]) == json.loads((release / "config.json").read_text())["num_layers"]
    assert _logits_match(inputs, model)
    adapted = _lora_trains(inputs, model, pkg)
    assert {name.rpartition(".")[2] for name in adapted} >= {"q_a_proj", "kv_b_proj", "o_proj"}


def test_the_text_layers_are_those_beside_the_token_embedding(tiny_family):
    """Qwen3-Omni's thinker stores more audio-encoder layer tensors (audio_tower.layers.N) than text ones:
    the text decoder is the prefix holding the token embedding, so the LoRA plan adapts the text attention
    the loss runs through, and every adapted module gets a gradient."""
    release, pkg = tiny_family("qwen3_omni_moe_thinker")
    inputs, model = _runtime(pkg)
    assert inputs.spec["naming"]["prefix"] == "model."
    adapted = _lora_trains(inputs, model, pkg)
    assert adapted and not any("audio_tower" in name for name in adapted)


def test_a_decoder_that_reshapes_the_embeddings_for_its_layers_runs_whole_as_its_own(tiny_family):
    """GLM-5-Next's decoder widens the embeddings into several residual streams before its layers (no tensor
    of that glue): found by running transformers' decoder on meta tensors, the whole model is its own and
    reproduces transformers' logits."""
    release, pkg = tiny_family("glm5_next")
    inputs, model = _runtime(pkg)
    assert "hands its layers hidden states" in inputs.spec["own_model"]
    assert _logits_match(inputs, model)


def _peft_export_matches(inputs, model, pkg, out) -> bool:
    """The package's LoRA plan on the model, B moved off zero, written in PEFT's format and loaded into
    transformers + peft: the same logits as ours."""
    from peft import PeftModel

    from onboard.package.export import write_peft
    from runtime.lora.factors import lora_state_dict

    config = read_lora_yaml(pkg / "lora.yaml", inputs.weight_map)
    apply_lora(model, config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    write_peft(out, lora_state_dict(model), config, inputs.spec["family"], inputs.weight_map, inputs.source)
    ids = random_tokens(read_spec(inputs.spec), 2, 11, seed=0)
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(load_reference(inputs.source, inputs.spec["family"], torch.float32), out)
        return compare(model(ids), theirs.eval()(input_ids=ids, use_cache=False).logits.float(),
                       tolerance_for("model_logits", torch.float32)).passed


def test_a_target_peft_would_read_as_an_expert_name_is_exported_through_its_weight(tiny_family, tmp_path):
    """AFMoE's attention has its own gate_proj (nn.Linear), a name PEFT's MoE conversion reads as the experts'
    pre-fusion gate_proj: the export targets it as the parameter gate_proj.weight, and loads and matches."""
    release, pkg = tiny_family("afmoe")
    assert "model.layers.*.self_attn.gate_proj" in (pkg / "lora.yaml").read_text()
    inputs, model = _runtime(pkg)
    assert _peft_export_matches(inputs, model, pkg, tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert not any(m.endswith("gate_proj") for m in config["target_modules"])
    assert any(p.endswith("self_attn.gate_proj.weight") for p in config["target_parameters"])


def test_an_own_layer_takes_lora_on_its_attention_linears_wherever_recognition_filed_them(tiny_family):
    """JetMoE's attention is a mixture of heads (its experts and router inside the attention module) beside one
    kv_proj: the plan targets kv_proj, never the router inside the attention, and it trains."""
    release, pkg = tiny_family("jetmoe")
    inputs, model = _runtime(pkg)
    targets = read_lora_yaml(pkg / "lora.yaml", inputs.weight_map).targets
    assert targets and all(t.endswith("self_attention.kv_proj") for t in targets)
    adapted = _lora_trains(inputs, model, pkg)
    assert adapted and all(name.endswith("self_attention.kv_proj") for name in adapted)


def test_a_tensor_transformers_splits_on_loading_takes_no_lora(tiny_family, tmp_path):
    """Sarvam-MoE releases a fused attention.query_key_value that transformers splits into q/k/v_proj: no one
    module holds it, so it is no LoRA target and maps to no runtime tensor; the plan's other projection
    (attention.dense, transformers' o_proj) exports to PEFT and matches."""
    release, pkg = tiny_family("sarvam_moe")
    weight_map = json.loads((pkg / "weight_map.json").read_text())
    assert weight_map["model.layers.0.attention.query_key_value.weight"]["own_module"] is None
    assert "query_key_value" not in (pkg / "lora.yaml").read_text()
    inputs, model = _runtime(pkg)
    assert _peft_export_matches(inputs, model, pkg, tmp_path / "peft")


def test_a_model_run_whole_as_its_own_takes_lora_on_its_text_attention(tiny_family):
    """Kimi-K2.5 names its layers `blocks` and runs whole as transformers' own: token ids (image placeholders
    too) give transformers' logits; the plan's targets are found by their transformers names, the text
    decoder's attention projections only (not the vision tower's), and train."""
    release, pkg = tiny_family("kimi_k25")
    inputs, model = _runtime(pkg)
    # token ids run through the multimodal model's own path, which maps image/video placeholders to a plain token
    ids = random_tokens(read_spec(inputs.spec), 2, 11, seed=0)
    ids[:, 3] = json.loads((release / "config.json").read_text())["image_token_id"]
    with torch.no_grad():
        theirs = load_reference(inputs.source, inputs.spec["family"], torch.float32)(input_ids=ids, use_cache=False).logits
        assert compare(model(ids), theirs.float(), tolerance_for("model_logits", torch.float32)).passed
    adapted = _lora_trains(inputs, model, pkg)
    assert adapted and all(n.startswith("own.module.model.language_model.layers.") and ".self_attn." in n for n in adapted)


def test_without_a_layer_count_key_the_layers_are_counted_in_transformers_model(tiny_family):
    """Nemotron-H says its depth by a list of block types (and stores an infinite float as transformers encodes it):
    transformers' model of the release counts the layers, and recognition goes on from there."""
    release, _ = tiny_family("nemotron_h")
    config = json.loads((release / "config.json").read_text())
    assert not {"num_hidden_layers", "num_layers", "n_layer"} & set(config)
    assert recognize(read_manifest(release)).num_layers == len(config["layers_block_type"])


def test_a_vision_tower_not_read_as_ours_is_a_gap_and_the_text_path_goes_on(tiny_family):
    """Unlimited-OCR's vision config has no depth key (its towers say theirs in sub-configs): the tower is noted as
    not understood, image inputs unsupported, and the text model is recognized."""
    release, _ = tiny_family("unlimited_ocr")
    spec = recognize(read_manifest(release))
    assert spec.vision is None and spec.layers
    assert any(u.item == "vision tower not understood" and "vision_config.depth" in u.source for u in spec.unrecognized)


def test_an_adapter_key_peft_would_move_on_loading_is_stored_under_the_release_name(tiny_family, tmp_path):
    """Unlimited-OCR's checkpoint renaming `(^|model.)layers.` -> `language_model.layers.` also matches inside
    transformers' own `model.language_model.layers.`, and PEFT applies it to adapter keys on loading: those factors
    are stored under the release's names (`model.layers.N...`), which it maps home; the export loads and matches."""
    from safetensors import safe_open

    release, pkg = tiny_family("unlimited_ocr")
    inputs, model = _runtime(pkg)
    assert _peft_export_matches(inputs, model, pkg, tmp_path / "peft")
    with safe_open(tmp_path / "peft" / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("base_model.model.model.layers.") for k in keys)


def test_the_whole_model_takes_what_its_head_takes(tiny_family, tmp_path):
    """Inkling divides the final hidden states by `logits_mup_width_multiplier` in its causal-LM forward, before
    the head: run as its own model (the demotion's last rung), the head takes what that forward feeds it, so the
    logits are transformers'."""
    release, _ = tiny_family("inkling_text")
    manifest = read_manifest(release)
    assert manifest.config["logits_mup_width_multiplier"] not in (None, 1, 1.0)
    failed = Check(tier=2, name="logits/float32", metric="rel_rms", value=23.0, tolerance=1e-4, verdict="fail")
    step = demotion_step(recognize(manifest), "model", [failed])
    pkg, _ = write_package(release, tmp_path / "pkg", spec_steps=[step])
    inputs, model = _runtime(pkg)
    assert _logits_match(inputs, model)


def test_a_final_logit_softcap_caps_the_logits_and_the_training_loss(tiny_family):
    """Inkling-2 caps its logits (c * tanh(z / c), config final_logit_softcapping) after the LM head: the spec
    carries the cap, and the runtime's logits and its chunked training loss apply it as transformers does
    (at this size the uncapped logits miss the fp32 bar)."""
    from runtime.train.data import IGNORE
    from runtime.train.loop import loss_sum

    release, pkg = tiny_family("inkling2_text")
    inputs, model = _runtime(pkg)
    cap = inputs.spec["final_logit_softcapping"]
    assert cap == json.loads((release / "config.json").read_text())["final_logit_softcapping"]
    assert _logits_match(inputs, model)
    ids = random_tokens(read_spec(inputs.spec), 1, 13, seed=2)
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
    from onboard.align.tiers import own_choices
    from onboard.align.tiers.tier2_model import tier2

    release, pkg = tiny_family("minimax_m2")
    inputs = read_package(pkg)
    ids, fp32, free, pinned = random_tokens(read_spec(inputs.spec), 2, 24, seed=1), {}, {}, {}
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
    checks = {c.name: c for c in tier2(read_spec(inputs.spec), inputs.weight_map, inputs.source, inputs.spec["num_layers"])[0]}
    assert checks["logits/bfloat16"].verdict == "pass" and checks["logits/bfloat16"].value <= 2e-2
