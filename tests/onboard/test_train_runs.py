"""`onboard train` as a user's first hour meets it (issue 55): a run folder holds one run, a resume keeps the math
and says where it starts, flags are checked before any work, a package new-model did not leave trainable is refused
at once, and a YAML config is the same run as its flags. In-process (the CLI's own `main`) on the tiny qwen3_moe
package, 2-3 steps of 16 tokens."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from onboard.cli import main
from runtime.train.metrics import read_metrics

FAMILY = "qwen3_moe"


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny shapes on shared cores: a second intra-op thread only spins (tests/runtime/conftest.py)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": f"The mill number {i} turns by the river."}) + "\n" for i in range(8)))
    return path


@pytest.fixture
def package(example_package, tmp_path) -> Path:
    """A private copy: default run folders are made inside the package."""
    return shutil.copytree(example_package(FAMILY), tmp_path / "pkg")


def train(pkg: Path, data: Path, *flags: str) -> list[str]:
    return ["train", str(pkg), "--data", str(data), "--seq-len", "16", "--no-progress", "--no-cuda-graph", *flags]


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl")[0]]


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def test_a_run_folder_holds_one_run(package, data, tmp_path, capsys):
    """Training into a run folder that holds a run is refused without --resume (it used to delete the new run's
    final checkpoint and leave a later --resume continuing the old run); without --out each run gets its own."""
    run = tmp_path / "run"
    assert main(train(package, data, "--steps", "2", "--out", str(run))) == 0
    before = {p.name: p.read_bytes() for p in (run / "metrics.jsonl", run / "run.json")}
    capsys.readouterr()
    assert main(train(package, data, "--steps", "3", "--out", str(run))) == 2
    assert one_error_line(capsys) == (f"onboard: error: {run}: holds a run already (last checkpoint: step 2): pass "
                                      "--resume to continue it, or another --out for a new run (a run folder holds one "
                                      "run)")
    assert {p.name: p.read_bytes() for p in (run / "metrics.jsonl", run / "run.json")} == before
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    assert main(train(package, data, "--steps", "1", "--out", str(tmp_path / "notes"))) == 2
    assert "not empty and not a run folder" in one_error_line(capsys)
    assert main(train(package, data, "--steps", "1")) == 0
    assert main(train(package, data, "--steps", "1")) == 0
    runs = sorted((package / "runs").iterdir())
    assert len(runs) == 2 and all((r / "adapter" / "adapter.safetensors").exists() for r in runs)
    assert all(len(losses(r)) == 1 for r in runs)


def test_resume_keeps_the_math_and_says_where_it_starts(package, data, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(train(package, data, "--steps", "2", "--out", str(run), "--checkpoint-every", "1")) == 0
    recorded = (run / "run.json").read_bytes()
    capsys.readouterr()
    # settings that change what the run computes: each named, run.json untouched
    assert main(train(package, data, "--steps", "3", "--out", str(run), "--resume", "--seq-len", "32", "--lr",
                      "1e-3", "--seed", "4")) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"onboard: error: {run / 'run.json'}: --resume with other settings: ")
    assert "--seq-len 32 where the run has 16" in line and "--lr 0.001 where the run has 0.0001" in line
    assert "--seed 4 where the run has 0" in line and "--steps" not in line
    edited = tmp_path / "edited.jsonl"
    edited.write_text(data.read_text() + json.dumps({"text": "one more document"}) + "\n")
    assert main(train(package, edited, "--steps", "3", "--out", str(run), "--resume")) == 2
    assert "--data " in one_error_line(capsys)
    assert main(train(package, data, "--steps", "1", "--out", str(run), "--resume")) == 2
    assert one_error_line(capsys).startswith("onboard: error: <input>: --steps: 1 is below step 2 that ")
    assert (run / "run.json").read_bytes() == recorded
    # --steps may extend the run; eval and checkpoint cadence do not change the math
    assert main(train(package, data, "--steps", "3", "--out", str(run), "--resume", "--eval-every", "7")) == 0
    said = capsys.readouterr().err
    assert (f"onboard: resuming {run} from its checkpoint at step 2, to step 3 (it was to end at 2: the learning-rate "
            "schedule from step 2 on follows 3 steps)") in said
    assert len(losses(run)) == 3
    info = json.loads((run / "run.json").read_text())
    assert info["train"]["steps"] == 3 and info["train"]["eval_every"] == 7 and info["math"]["seq_len"] == 16
    # a run with no complete checkpoint starts again, and says so
    shutil.rmtree(run / "checkpoints")
    assert main(train(package, data, "--steps", "2", "--out", str(run), "--resume")) == 0
    assert f"onboard: {run} has no complete checkpoint yet: training it again from step 0" in capsys.readouterr().err
    assert len(losses(run)) == 2


def test_resume_of_nothing_is_refused(package, data, tmp_path, capsys):
    assert main(train(package, data, "--steps", "1", "--out", str(tmp_path / "new"), "--resume")) == 2
    assert "nothing to resume: no run.json" in one_error_line(capsys)
    assert main(train(package, data, "--steps", "1", "--resume")) == 2
    assert one_error_line(capsys) == (f"onboard: error: {package / 'runs'}: nothing to resume: no run folder here; "
                                      "train without --resume to start one, or name the run with --out RUN")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("flags, named", [
    (("--lr", "-1"), "--lr"), (("--lr", "nan"), "--lr"), (("--eval-fraction", "1.5"), "--eval-fraction"),
    (("--eval-fraction", "0"), "--eval-fraction"), (("--steps", "-3"), "--steps"), (("--steps", "0"), "--steps"),
    (("--warmup-steps", "-1"), "--warmup-steps"), (("--weight-decay", "-0.1"), "--weight-decay"),
    (("--seed", "-1"), "--seed"), (("--capacity-factor", "0"), "--capacity-factor"),
    (("--bias-update-rate", "-1e-3"), "--bias-update-rate"), (("--aux-loss-coef", "inf"), "--aux-loss-coef"),
    (("--batch-size", "1.5"), "--batch-size"),
], ids=lambda v: "_".join(v) if isinstance(v, tuple) else None)
def test_a_bad_flag_is_one_line_naming_it(flags, named, tmp_path, capsys):
    """Refused while parsing, before the package is read (it does not even exist here)."""
    with pytest.raises(SystemExit) as exited:
        main(["train", str(tmp_path / "absent"), "--data", "x.jsonl", *flags])
    assert exited.value.code == 2
    line = one_error_line(capsys)
    assert line.startswith(f"onboard train: error: argument {named}: "), line


@pytest.mark.parametrize("flags, named", [(("--nnodes", "2"), "--rdzv-endpoint"), (("--nproc", "2", "--ep", "3"), "--ep"),
                                          (("--nnodes", "2", "--rdzv-endpoint", "host:29500"), "--out")])
def test_flags_that_go_together_are_checked_before_any_work(flags, named, tmp_path, capsys):
    assert main(["train", str(tmp_path / "absent"), "--data", "x.jsonl", *flags]) == 2
    assert one_error_line(capsys).startswith(f"onboard: error: <input>: {named}: ")


def test_a_package_with_gaps_is_refused_at_once(index_only_gap_release, data, tmp_path, capsys):
    """Mixtral without expert 3's weights: new-model leaves it `gaps`. train used to build the model and end in an
    internal error; now train and bench exit 3 before reading any weight, with package.yaml's reasons."""
    pkg = tmp_path / "pkg"
    assert main(["new-model", str(index_only_gap_release), "--out", str(pkg)]) == 3
    manifest = yaml.safe_load((pkg / "package.yaml").read_text())
    assert manifest["status"] == "gaps"
    capsys.readouterr()
    assert main(train(pkg, data, "--steps", "1", "--out", str(tmp_path / "run"))) == 3
    line = one_error_line(capsys)
    assert line.startswith(f"onboard: gap: {pkg / 'package.yaml'}: status 'gaps', not 'trainable': "), line
    assert manifest["reasons"][0] in line
    assert not (tmp_path / "run").exists()
    assert main(["bench", str(pkg), "--steps", "1", "--seq-len", "16"]) == 3
    assert one_error_line(capsys) == line


def test_a_yaml_config_is_the_same_run_as_its_flags(package, data, tmp_path, capsys):
    flags = ["--steps", "3", "--lr", "1e-3", "--warmup-steps", "2", "--weight-decay", "0.01", "--seed", "3",
             "--eval-every", "2", "--checkpoint-every", "3"]
    assert main(train(package, data, *flags, "--out", str(tmp_path / "by-flags"))) == 0
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"data": str(data), "steps": 5, "lr": 1e-3, "warmup-steps": 2,
                                      "weight_decay": 0.01, "seed": 3, "eval_every": 2, "checkpoint_every": 3,
                                      "seq_len": 16, "no_progress": True, "no_cuda_graph": True, "batch_size": None}))
    # flags on the command line override the file's keys (steps: 5 in the file)
    assert main(["train", str(package), "--config", str(config), "--steps", "3",
                 "--out", str(tmp_path / "by-config")]) == 0
    assert losses(tmp_path / "by-config") == losses(tmp_path / "by-flags") and len(losses(tmp_path / "by-flags")) == 3
    kept = yaml.safe_load((tmp_path / "by-config" / "config.yaml").read_text())
    assert kept == yaml.safe_load((tmp_path / "by-flags" / "config.yaml").read_text())
    assert kept["warmup_steps"] == 2 and kept["lr"] == 1e-3 and "out" not in kept and "resume" not in kept
    # the run's resolved config reads back as a config: the same settings again
    capsys.readouterr()
    assert main(["train", str(package), "--config", str(tmp_path / "by-config" / "config.yaml"), "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == kept
    assert main(["train", str(package), "--config", str(config), "--steps", "7", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["steps"] == 7


@pytest.mark.parametrize("text, key, needle", [
    ("sequence_length: 64\n", "sequence_length", "not a flag of `onboard train`"),
    ("lr: -1\n", "lr", "expected a positive finite number, got -1"),
    ("no_progress: 3\n", "no_progress", "expected true or false"),
    ("steps: [1, 2]\n", "steps", "expected a single value"),
    ("- steps\n", None, "expected a mapping of flag: value"),
])
def test_a_bad_config_file_is_one_line_naming_file_and_key(text, key, needle, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    assert main(["train", str(tmp_path / "absent"), "--config", str(config), "--data", "x.jsonl"]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"onboard: error: {config}: {key + ': ' if key else ''}") and needle in line, line


def test_tensorboard_events_and_plain_progress_lines(package, data, tmp_path, capsys):
    """Off a terminal (captured stderr here, a log file in a batch job) progress comes as plain lines, not a bar
    that shows only its end; --tensorboard writes events tensorboard's own reader loads, step by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert main(["train", str(package), "--data", str(data), "--seq-len", "16", "--steps", "3", "--eval-every", "3",
                 "--no-cuda-graph", "--tensorboard", "--out", str(run)]) == 0
    err = capsys.readouterr().err
    assert [line.split("  ")[0] for line in err.splitlines() if line.startswith("train step")] == \
        ["train step 1/3", "train step 2/3", "train step 3/3"]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == \
        [(i + 1, pytest.approx(loss, rel=1e-6)) for i, loss in enumerate(losses(run))]
    assert [e.step for e in events.Scalars("eval/loss")] == [3]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s"} <= set(events.Tags()["scalars"])
    assert any(tag.startswith("train/expert_imbalance/layer") for tag in events.Tags()["scalars"])


def test_wandb_offline_logs_without_a_network(package, data, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb package (pyproject's logging extra) is not installed here")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    assert main(train(package, data, "--steps", "2", "--wandb", "first-hour", "--out", str(run))) == 0
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb")), list((run / "wandb").iterdir())


def test_help_shows_defaults_and_version_is_printed(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--steps STEPS optimizer steps (default 100)", "(default 2048)", "--seed SEED", "(default 0.0001)",
                  "--eval-fraction EVAL_FRACTION documents held out for eval loss (default 0.1)"):
        assert shown in text, shown
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("onboard ")
