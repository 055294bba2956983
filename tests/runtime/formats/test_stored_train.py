"""Training on a stored base: the trainer's bf16 model of an FP8 release (built as `train` builds it) lowers the loss
at a fixed seed holding codes and scales only, and `onboard train` on the MXFP4 gpt_oss example release does too
and writes an adapter of LoRA factors only."""
from __future__ import annotations

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file

from onboard.examples.models import write_example_model
from onboard.package.trainer_build import build_model, load_tokenizer, memory_policy, prepare_data, read_lora
from runtime.formats.weight import StoredWeight
from runtime.train.loop import TrainConfig, train
from runtime.train.metrics import read_metrics
from tests.runtime.test_train import write_data

CONFIG = TrainConfig(steps=8, lr=3e-3, warmup_steps=1, eval_every=8, checkpoint_every=8, keep_last=1)


def _falls(losses: list[float]) -> bool:
    return len(losses) == 8 and sum(losses[-2:]) / 2 < losses[0]


def test_fixed_seed_training_on_an_fp8_base_lowers_the_loss(stored_package, tmp_path):
    spec, weight_map, source, pkg = stored_package("qwen3_moe", "fp8")
    data = prepare_data(write_data(tmp_path / "data.jsonl"), load_tokenizer(source), 32, 0.2, 0)
    model = build_model(spec, weight_map, source, read_lora(pkg, weight_map), memory_policy(pkg, None, None), "cpu")
    stored = [m for m in model.modules() if isinstance(m, StoredWeight)]
    assert stored and all(m.dtype == torch.bfloat16 and m.codes.dtype == torch.uint8 for m in stored)
    assert {p.dtype for p in model.parameters() if not p.requires_grad} <= {torch.bfloat16, torch.uint8, torch.int32}
    torch.manual_seed(0)
    train(model, data, CONFIG, tmp_path / "run", progress=False)
    assert _falls([r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")[0]])


def test_onboard_train_on_the_mxfp4_example(tmp_path):
    from onboard.package.writer import write_package

    release = write_example_model("gpt_oss", tmp_path / "release", weights="mxfp4")
    pkg, _ = write_package(release, tmp_path / "pkg")
    assert any("stored" in e for e in json.loads((pkg / "weight_map.json").read_text()).values())
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "onboard.cli", "train", str(pkg), "--data", str(write_data(tmp_path / "d.jsonl")),
                           "--steps", "8", "--seq-len", "32", "--lr", "3e-3", "--eval-every", "8", "--checkpoint-every", "8",
                           "--no-progress", "--out", str(run)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _falls([r["loss"] for r in read_metrics(run / "metrics.jsonl")[0]])
    adapter = load_file(run / "adapter" / "adapter.safetensors")
    assert adapter and all(".lora_" in name for name in adapter)
