"""The training loop on tiny example packages: exact resume, a SIGKILL in the middle of a save, non-finite
steps, the run folder; `onboard train` as a user runs it."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch.optim.optimizer import register_optimizer_step_post_hook

from onboard.package.trainer_build import build_model, load_tokenizer, memory_policy, prepare_data, read_lora
from runtime.train import checkpoint
from runtime.train.loop import TrainConfig, TrainingAborted, lr_at, train
from runtime.train.metrics import read_metrics

SHORT = TrainConfig(steps=4, batch_size=1, grad_accum=2, lr=1e-3, warmup_steps=1, eval_every=2, checkpoint_every=1,
                    keep_last=1)


def write_data(path: Path) -> Path:
    lines = [{"text": f"The river runs past mill number {i} and under the stone bridge."} for i in range(8)]
    lines += [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                            {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(8)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _setup(package: Path, tmp_path: Path):
    import yaml

    spec = json.loads((package / "spec.json").read_text())
    weight_map = json.loads((package / "weight_map.json").read_text())
    release = Path(yaml.safe_load((package / "package.yaml").read_text())["source"]["absolute"])
    data = prepare_data(write_data(tmp_path / "data.jsonl"), load_tokenizer(release), 32, 0.2, 0)
    model = build_model(spec, weight_map, release, read_lora(package, weight_map), memory_policy(package, None, None),
                        "cpu")
    return model, data


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl")[0]]


class Interrupted(Exception):
    pass


def test_resume_is_bit_exact(example_package, tmp_path, monkeypatch):
    """4 straight steps vs 2 steps, a crash right after the step-2 checkpoint, and a resume (qwen3_5_moe)."""
    package = example_package("qwen3_5_moe")
    train(*_setup(package, tmp_path), SHORT, tmp_path / "straight", progress=False)
    real_save = checkpoint.save

    def save_then_crash(root, model, optimizer, state, keep_last):
        folder = real_save(root, model, optimizer, state, keep_last)
        if state["step"] == 2:
            raise Interrupted
        return folder

    monkeypatch.setattr(checkpoint, "save", save_then_crash)
    with pytest.raises(Interrupted):
        train(*_setup(package, tmp_path), SHORT, tmp_path / "resumed", progress=False)
    monkeypatch.setattr(checkpoint, "save", real_save)
    state = train(*_setup(package, tmp_path), SHORT, tmp_path / "resumed", resume=True, progress=False)
    straight = _losses(tmp_path / "straight")
    assert len(straight) == 4 and _losses(tmp_path / "resumed") == straight
    assert state["step"] == 4 and state["best_step"] in (2, 4)
    kept = {p.name for p in checkpoint.complete_steps(tmp_path / "resumed" / "checkpoints")}
    assert kept == {"step-00000004", f"step-{state['best_step']:08d}"}
    assert {"loss.png", "grad_norm.png", "expert_load.png"} <= {p.name for p in (tmp_path / "resumed").iterdir()}


def test_non_finite_steps_are_skipped_then_abort(example_package, tmp_path):
    """A NaN injected into one batch's embeddings skips that step only (no optimizer update); NaN in every
    batch from step 3 on aborts after max_bad_steps, naming the step (qwen3_moe, a classic MoE)."""
    model, data = _setup(example_package("qwen3_moe"), tmp_path)
    forwards, poisoned = {"n": 0}, {3, 4}  # forwards 3 and 4 are step 2's micro-batches (grad_accum 2)

    def poison(module, args, output):
        forwards["n"] += 1
        return output * float("nan") if forwards["n"] in poisoned else output

    model.embed_tokens.register_forward_hook(poison)
    updates = []
    hook = register_optimizer_step_post_hook(lambda opt, args, kwargs: updates.append(1))
    cfg = TrainConfig(**{**SHORT.__dict__, "steps": 3, "eval_every": 100, "checkpoint_every": 100})
    train(model, data, cfg, tmp_path / "run", progress=False)
    hook.remove()
    train_lines = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert [r["skipped"] for r in train_lines] == [False, True, False] and len(updates) == 2
    forwards["n"] = 0
    poisoned.clear()
    poisoned.update(range(5, 100))
    cfg = TrainConfig(**{**SHORT.__dict__, "steps": 6, "max_bad_steps": 2, "eval_every": 100, "checkpoint_every": 100})
    with pytest.raises(TrainingAborted, match=r"^step 4: .*2 non-finite steps in a row"):
        train(model, data, cfg, tmp_path / "run2", progress=False)


DRIVER = textwrap.dedent("""
    import sys, time
    import torch.distributed.checkpoint as dcp
    from onboard.cli import main
    real_save = dcp.save

    def slow_save(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)
        if ".step-00000003.partial" in str(checkpoint_id):
            print("SAVING step 3", flush=True)
            time.sleep(120)

    dcp.save = slow_save
    sys.exit(main(sys.argv[1:]))
""")


# tiny shapes: more than one thread per process only spins (see tests/runtime/conftest.py)
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def onboard_train(*args: str, driver: str | None = None) -> list[str]:
    code = ["-c", driver] if driver else ["-m", "onboard.cli"]
    return [sys.executable, *code, "train", *args, "--no-progress"]


def test_sigkill_during_save_loses_only_the_unfinished_step(example_package, tmp_path):
    """A real `onboard train` process is SIGKILLed while it writes the step-3 checkpoint (the test stretches
    that save with a sleep after DCP wrote its files, before the commit rename); `--resume` restarts from
    step 2 and repeats step 3 with the same loss bit for bit (qwen3_next)."""
    package, run = example_package("qwen3_next"), tmp_path / "run"
    args = (str(package), "--data", str(write_data(tmp_path / "data.jsonl")), "--steps", "4", "--seq-len", "32",
            "--checkpoint-every", "1", "--eval-every", "2", "--out", str(run))
    child = subprocess.Popen(onboard_train(*args, driver=DRIVER), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=ONE_THREAD)
    for line in child.stdout:
        if line.startswith("SAVING step 3"):
            os.kill(child.pid, signal.SIGKILL)
            break
    assert child.wait(timeout=60) == -signal.SIGKILL, child.stderr.read()
    assert (run / "checkpoints" / ".step-00000003.partial").exists()
    killed = _losses(run)
    assert len(killed) == 3
    resumed = subprocess.run(onboard_train(*args, "--resume"), capture_output=True, text=True, timeout=600, env=ONE_THREAD)
    assert resumed.returncode == 0, resumed.stderr
    losses = _losses(run)
    assert len(losses) == 4 and losses[:3] == killed
    assert not (run / "checkpoints" / ".step-00000003.partial").exists()
    assert (run / "checkpoints" / "step-00000004").exists()
    assert (run / "run.json").exists() and (run / "adapter" / "adapter.safetensors").exists()
    # CUDA graphs are on by default (there is no CUDA device here: every step ran eagerly)
    assert json.loads((run / "run.json").read_text())["train"]["cuda_graph"] is True


def test_malformed_data_line_exits_2_before_any_step(example_package, tmp_path):
    data = write_data(tmp_path / "data.jsonl")
    data.write_text(data.read_text() + '{"messages": "oops"}\n')
    result = subprocess.run(onboard_train(str(example_package("deepseek_v32")), "--data", str(data), "--out",
                                          str(tmp_path / "run")), capture_output=True, text=True, timeout=300,
                            env=ONE_THREAD)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"onboard: error: {data}: line 17: \"messages\" must be a non-empty list"]
    assert not (tmp_path / "run").exists()


def test_schedule_warms_up_then_follows_the_cosine_to_its_floor():
    cfg = TrainConfig(steps=12, lr=1.0, warmup_steps=2, min_lr_ratio=0.1)
    lrs = [lr_at(step, cfg) for step in range(12)]
    assert lrs[:3] == [0.5, 1.0, 1.0] and lrs[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))
    assert lrs[7] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 9)))

