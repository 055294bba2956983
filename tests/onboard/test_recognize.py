"""`onboard inspect --json` on every family's tiny release, checked against transformers' own model.

The expected values come from a meta-device build of the transformers class (module classes,
expert modules, router top-k, parameter count), not from our recognizer.
"""
from __future__ import annotations

import json

import pytest
import torch

from onboard.cli import main
from onboard.examples.models import FAMILIES, example_config
from onboard.release.transformers_classes import model_class

# transformers attention module class -> the kind our spec must report
ATTENTION_KIND_OF_CLASS = {
    "Qwen3NextGatedDeltaNet": "gated_delta", "Qwen3_5MoeGatedDeltaNet": "gated_delta",
    "KimiLinearDeltaAttention": "kda", "KimiLinearAttention": "mla", "MiniMaxLightningAttention": "lightning",
    "DeepseekV32Attention": "mla_dsa", "DeepseekV3Attention": "mla",
}


def _transformers_layers(family: str):
    with torch.device("meta"):
        model = model_class(family)(example_config(family))
    decoder = next(m for m in model.modules() if hasattr(m, "layers") and hasattr(m, "embed_tokens"))
    return model, list(decoder.layers)


def _expected_layer(layer) -> dict:
    attn = getattr(layer, "linear_attn", None) or layer.self_attn
    ffn = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe")
    kind = ATTENTION_KIND_OF_CLASS.get(type(attn).__name__, "softmax")
    experts = getattr(ffn, "experts", None)
    if experts is None:
        return {"attention": kind, "ffn": "dense"}
    router = getattr(ffn, "gate", None) or getattr(ffn, "router")
    shared = any(hasattr(ffn, n) for n in ("shared_expert", "shared_experts"))
    return {"attention": kind, "ffn": "moe", "experts": experts.num_experts, "top_k": router.top_k, "shared": shared}


def _spec_layer(layer: dict) -> dict:
    attn, ffn = layer["attention"], layer["ffn"]
    kind = "mla_dsa" if attn["kind"] == "mla" and attn.get("indexer") else attn["kind"]
    if ffn["kind"] == "dense":
        return {"attention": kind, "ffn": "dense"}
    return {"attention": kind, "ffn": "moe", "experts": ffn["num_experts"], "top_k": ffn["top_k"],
            "shared": ffn["num_shared_experts"] > 0}


@pytest.fixture(scope="module")
def inspected(example_release, tmp_path_factory):
    def run(family: str) -> dict:
        out = tmp_path_factory.mktemp("inspect") / "report.json"
        import contextlib, io
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            code = main(["inspect", str(example_release(family)), "--json"])
        assert code == 0, f"inspect exited {code}"
        out.write_text(buffer.getvalue())
        return json.loads(buffer.getvalue())
    return run


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_matches_transformers(family, inspected, example_release):
    from onboard.recognize.recognizer import recognize
    from onboard.release.manifest import read_manifest

    report = inspected(family)
    model, layers = _transformers_layers(family)
    spec = recognize(read_manifest(example_release(family)))
    assert [_spec_layer(l.model_dump()) for l in spec.layers] == [_expected_layer(l) for l in layers]

    saved = set(model.state_dict())
    meta_params = sum(p.numel() for p in model.parameters())
    meta_params += sum(b.numel() for n, b in model.named_buffers() if n in saved)
    m = report["model"]
    assert m["params_total"] + m["params"]["buffers"] == meta_params
    # the count from the spec agrees with the safetensors headers' byte count (bf16: 2 bytes/param)
    assert abs(m["params_total"] + m["params"]["buffers"] - m["manifest_params"]) <= 0.005 * m["manifest_params"]
    assert report["meta_check"]["params_agree"] and not report["meta_check"]["layer_disagreements"]
    assert m["params_active"] < m["params_total"]
    assert all(op["status"] == "covered" for op in report["ops"]), [o for o in report["ops"] if o["status"] != "covered"]
    assert report["weights"]["missing"] == [] and report["weights"]["unexpected"] == []
    assert report["unrecognized"] == []


def test_config_widths_follow_the_transformers_config(example_release):
    """Spot-check widths against the config object for the families with the most variants."""
    from onboard.recognize.recognizer import recognize
    from onboard.release.manifest import read_manifest

    cfg = example_config("qwen3_next")
    spec = recognize(read_manifest(example_release("qwen3_next")))
    gdn = spec.layers[0].attention
    assert (gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim) == (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim)
    full = spec.layers[3].attention
    assert full.output_gate and full.qk_norm == "head" and full.rope.rotary_dim == int(cfg.head_dim * 0.25)
    assert spec.norm.kind == "rms_1p" and spec.layers[0].ffn.shared_expert_gate

    gpt = recognize(read_manifest(example_release("gpt_oss")))
    assert gpt.layers[0].attention.sliding_window == 8 and gpt.layers[0].attention.sinks
    assert gpt.layers[1].attention.sliding_window is None
    assert gpt.layers[0].ffn.router.topk_before_softmax and gpt.layers[0].ffn.router.bias
    assert gpt.layers[0].ffn.swiglu_limit == 7.0 and gpt.layers[0].ffn.interleaved_gate_up

    ds = recognize(read_manifest(example_release("deepseek_v3")))
    router = ds.layers[1].ffn.router
    assert (router.scoring, router.correction_bias, router.num_groups, router.topk_groups) == ("sigmoid", True, 4, 2)
    assert ds.layers[1].attention.rope.interleaved and ds.layers[0].ffn.kind == "dense"

    olmoe = recognize(read_manifest(example_release("olmoe")))
    assert olmoe.layers[0].attention.qk_norm == "full" and not olmoe.layers[0].ffn.router.norm_topk_prob

    vl = recognize(read_manifest(example_release("qwen3_5_moe")))
    assert vl.vision is not None and vl.vision.depth == 2 and vl.layers[3].attention.rope.mrope_section == [2, 1, 1]


def test_seed_flagship_from_keys_and_names(seed_dir):
    """The 2.81T example: a custom model type no library knows, index only."""
    from onboard.gap.budget import budget
    from onboard.gap.report import analyze
    from onboard.recognize.recognizer import recognize
    from onboard.release.manifest import read_manifest

    manifest = read_manifest(seed_dir)
    spec = recognize(manifest)
    report = analyze(spec, manifest, gpu_mem_gib=141.0)
    m = report.model
    assert abs(m["params_total"] - 2.81e12) <= 0.01 * 2.81e12
    assert abs(m["params_total"] - manifest.total_bytes / 2) <= 0.005 * manifest.total_bytes / 2
    assert (m["num_experts"], m["top_k"], m["num_shared_experts"]) == (896, 16, 1)
    assert m["attention_kinds"]["linear"] == 46 and m["attention_kinds"]["sparse"] == 15
    assert {l.attention.kind for l in spec.layers if l.attention.kind != "mla"} == {"kda"}
    assert all(l.attention.indexer.topk == 2048 for l in spec.layers if l.attention.kind == "mla")
    assert m["vision"]["depth"] == 27 and report.meta_check is None
    # the minimum GPU count is the smallest that holds weights + LoRA states beside the activations
    mem = report.memory
    per_gpu = 141.0 * 0.9 - mem.per_gpu_activations_gib - 4.0
    assert (mem.min_gpus - 1) * per_gpu < mem.weights_gib + mem.lora_states_gib <= mem.min_gpus * per_gpu
    assert budget(spec, 80.0).min_gpus > mem.min_gpus
    assert any("auto_map" in u.source for u in report.unrecognized)


def test_mla_rope_layout_without_a_key_is_read_off_the_family_s_rotary_function(tiny_family, example_release):
    """DeepSeek-V2's config has no rope_interleave key but its attention rotates adjacent channel pairs
    (complex multiplication): transformers' own rotary function says so, and the spec follows it; a
    half-split family's function says halves."""
    from onboard.recognize.meta_check import rope_pairs_interleaved
    from onboard.release.manifest import read_manifest

    release, pkg = tiny_family("deepseek_v2")
    assert "rope_interleave" not in json.loads((release / "config.json").read_text())
    assert rope_pairs_interleaved(read_manifest(release)) is True
    assert json.loads((pkg / "spec.json").read_text())["layers"][0]["attention"]["rope"]["interleaved"] is True
    assert rope_pairs_interleaved(read_manifest(example_release("qwen3_moe"))) is False


def test_a_multimodal_rope_without_mrope_section_takes_the_split_transformers_applies(tiny_family):
    """Qwen3.5-MoE's default config has no mrope_section (its rotary module falls back to a default split):
    transformers' rotary module is probed for the split, so our 3-axis tables are its own and the vision
    path matches transformers' multimodal run at the fp32 bar (registry ops only, no own modules)."""
    from onboard.align.reference import load_reference
    from onboard.align.tiers.vision import vision_checks
    from onboard.package.reader import read_package
    from runtime.model.own_modules import text_decoder
    from runtime.model.rotary import cos_sin
    from runtime.spec import read_spec
    from runtime.tolerances import assert_close

    release, pkg = tiny_family("qwen3_5_moe")
    assert "mrope_section" not in json.loads((release / "config.json").read_text())["text_config"]["rope_parameters"]
    inputs = read_package(pkg)
    assert all(layer["attention"]["kind"] != "own_module" for layer in inputs.spec["layers"])
    rope = next(layer.attention.rope for layer in read_spec(inputs.spec).layers if layer.attention.kind == "softmax")
    positions_3BT = torch.randint(0, 50, (3, 1, 9), generator=torch.Generator().manual_seed(0))
    rotary = text_decoder(load_reference(inputs.source, inputs.spec["family"], torch.float32)).rotary_emb
    theirs = rotary(torch.zeros(1, 9, 1), positions_3BT)
    ours = cos_sin(rope, positions_3BT)
    for name, a, b in zip(("cos", "sin"), ours, theirs):
        assert_close(a, b, "mrope_cos_sin", torch.float32, name=name)
    checks = vision_checks(read_spec(inputs.spec), inputs.weight_map, inputs.source, inputs.vision_config,
                           inputs.spec["num_layers"])
    assert all(c.verdict == "pass" for c in checks), [(c.name, c.value) for c in checks]


def test_situ_activation_carries_its_betas_into_the_spec(example_release, tmp_path):
    """Kimi K3 names SiTU-GLU by `hidden_act: "situ"` with activation_situ_beta / activation_situ_linear_beta:
    the spec's FFNs (dense, experts and shared experts) carry both, and the registry covers it exactly."""
    import shutil

    from onboard.recognize.recognizer import recognize
    from onboard.release.manifest import read_manifest
    from runtime.registry import OPS

    release = shutil.copytree(example_release("deepseek_v3"), tmp_path / "release")
    config = json.loads((release / "config.json").read_text())
    config.update(hidden_act="situ", activation_situ_beta=4, activation_situ_linear_beta=25)
    (release / "config.json").write_text(json.dumps(config))
    spec = recognize(read_manifest(release))
    ffns = [layer.ffn for layer in spec.layers]
    assert {ffn.kind for ffn in ffns} == {"dense", "moe"}
    assert all(ffn.activation == "situ" and ffn.situ_betas == (4.0, 25.0) for ffn in ffns)
    assert {OPS["moe_experts" if f.kind == "moe" else "swiglu_mlp"].supports(f) for f in ffns} == {"exact"}
