"""Load balancing in training (runtime/train/balance.py): the aux loss against transformers' own and against a plain
fp64 reference of the formula on the runtime's router outputs (value and gradients); the correction-bias update
step by step against its formula on the logged global counts, and a resume that restores the biases; the
`onboard train` defaults (off) and a real run that updated biases: saved beside the adapter, refused by the PEFT
export. Tier 3 (tests/runtime/test_parallel.py) checks both under FSDP and EP."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from onboard.align.reference import load_runtime
from onboard.commands.train import OptionGap, balance_options
from onboard.package.reader import read_package
from runtime.lora.factors import LoraConfig, apply_lora
from runtime.memory import MemoryPolicy, apply_memory_policy
from runtime.ops.moe.torch_form import router_logits
from runtime.parallel.placement import MeshShape
from runtime.train import balance
from runtime.train.data import Document, pack
from runtime.train.loop import TrainConfig, TrainData, train
from runtime.train.metrics import expert_counts, moe_layers, read_metrics
from runtime.train.run_folder import read_biases
from runtime.parallel.process import exit_without_teardown, finish

LORA = LoraConfig(rank=4, alpha=8, targets=("layers.*.attn.q_proj",), experts=True)
T = 48


def _package(pkg: Path) -> tuple[dict, dict, Path]:
    inputs = read_package(pkg)
    return inputs.spec, inputs.weight_map, inputs.source


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, T), generator=torch.Generator().manual_seed(3))


def _runtime_model(pkg: Path, trained_B: bool = True):
    """The release in fp32 with LoRA; trained_B: non-zero B factors (every LoRA factor then has a gradient)."""
    spec, weight_map, source = _package(pkg)
    model = load_runtime(spec, weight_map, source, torch.float32)
    apply_lora(model, LORA)
    with torch.no_grad():
        if not trained_B:
            return model, source
        for name, p in model.named_parameters():
            if name.endswith("_B"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    return model, source


def _forward(model, ids: torch.Tensor) -> None:
    model.hidden_states(ids, torch.arange(T)[None], cu_seqlens=torch.tensor([0, T], dtype=torch.int32))


def _ours(model, ids: torch.Tensor) -> torch.Tensor:
    balance.track_router_probs(model, True)
    _forward(model, ids)
    return balance.aux_loss_share(model, balance.global_counts(expert_counts(model), torch.device("cpu")))


def _plain_fp64(model, ids: torch.Tensor) -> torch.Tensor:
    """E * sum_e f_e P_e over the layers pooled, written out in fp64 from each router's input and choices."""
    inputs = {}
    hooks = [moe.router.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
             for i, moe in moe_layers(model).items()]
    balance.track_router_probs(model, False)
    _forward(model, ids)
    for h in hooks:
        h.remove()
    probs, chosen = [], []
    for i, moe in moe_layers(model).items():
        logits = router_logits(inputs[i], moe.router.effective_weight(), moe.router.bias).double()
        probs.append(logits.softmax(-1))
        chosen.append(torch.nn.functional.one_hot(moe.last_routing, logits.shape[1]).sum(1).double())
    num_experts = probs[0].shape[1]
    return num_experts * (torch.cat(chosen).mean(0) * torch.cat(probs).mean(0)).sum()


def _lora_grads(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every LoRA factor's gradient (zeros for those no router input depends on: the last layer's experts)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), grads)}


def test_aux_loss_equals_transformers_and_the_plain_formula(example_package, example_release):
    """qwen3_moe: the value equals transformers' model's aux_loss (output_router_logits) on the same weights and
    tokens; value and every LoRA gradient equal an fp64 plain-torch reference on the same router outputs, with
    the MoE blocks recomputed in backward (the routers' kept sums are reached through the checkpoint)."""
    from transformers import AutoModelForCausalLM

    model, source = _runtime_model(example_package("qwen3_moe"), trained_B=False)
    ids = _ids(model.config.vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        want = float(hf(input_ids=ids, output_router_logits=True).aux_loss)
    assert abs(float(_ours(model, ids).detach()) - want) <= 1e-5 * want
    model, _ = _runtime_model(example_package("qwen3_moe"))
    apply_memory_policy(model, MemoryPolicy(recompute=("moe",)))
    ours = _ours(model, ids)
    got_grads = _lora_grads(model, ours)
    plain = _plain_fp64(model, ids)
    assert abs(float(ours) - float(plain)) <= 1e-6 * float(plain)
    want_grads = _lora_grads(model, plain)
    assert sum(g.norm() > 0 for g in want_grads.values()) >= len(want_grads) // 2
    for name, g in want_grads.items():
        assert (got_grads[name].double() - g).norm() <= 1e-5 * g.norm(), name


def _data(vocab: int) -> TrainData:
    gen = torch.Generator().manual_seed(7)
    docs = [Document(torch.randint(3, vocab, (int(n),), generator=gen).tolist(), [True] * int(n))
            for n in torch.randint(8, 40, (14,), generator=gen)]
    return TrainData(pack(docs[:12], 32, 0), pack(docs[12:], 32, 0))


CONFIG = TrainConfig(steps=4, batch_size=2, lr=1e-3, warmup_steps=1, eval_every=4, checkpoint_every=2, keep_last=4,
                     aux_loss_coef=0.1, correction_bias_rate=1e-2)


def test_correction_bias_follows_the_step_loads_and_resumes(example_package, tmp_path):
    """glm4_moe, 4 steps: each step moves every bias by rate * sign(mean - load) of that step's logged counts;
    resuming the step-2 checkpoint repeats the straight run's losses, aux losses and biases exactly."""
    model, _ = _runtime_model(example_package("glm4_moe"))
    start = {i: b.clone() for i, b in balance.correction_biases(model).items()}
    assert start
    train(model, _data(model.config.vocab_size), CONFIG, tmp_path / "straight", progress=False)
    lines = read_metrics(tmp_path / "straight" / "metrics.jsonl")[0]
    for layer, bias in start.items():
        for line in lines:
            load = torch.tensor(line["expert_counts"][str(layer)], dtype=torch.float32)
            bias = bias + CONFIG.correction_bias_rate * torch.sign(load.mean() - load)
            assert torch.equal(torch.tensor(line["correction_bias"][str(layer)]), bias), line["step"]
        assert not torch.equal(bias, start[layer])
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step-00000004")
    model, _ = _runtime_model(example_package("glm4_moe"))
    train(model, _data(model.config.vocab_size), CONFIG, tmp_path / "resumed", resume=True, progress=False)
    keys = ("loss", "aux_loss", "correction_bias")
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")[0]
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in lines]


def _ep2_worker(rank: int, port: int, package: tuple, run_dir: Path) -> None:
    from runtime.parallel.load import build_sharded_model
    from runtime.parallel.parallelize import ParallelConfig, device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    spec, weight_map, source = package
    mesh = MeshShape(1, 2)
    model = build_sharded_model(spec, weight_map, source, LORA, ParallelConfig(mesh), device_mesh(mesh, "cpu"), rank,
                                torch.device("cpu"), torch.float32)
    # each rank one row per micro-batch: the expert GEMMs and the aux loss see the one process's 2 rows
    train(model, _data(spec["vocab_size"]), dataclasses.replace(CONFIG, batch_size=1), run_dir, progress=False)
    # the runtime's own end of a rank (runtime/parallel/process.py): leave the group, then exit without the
    # interpreter's teardown, which a gloo thread's late release can abort
    finish()
    exit_without_teardown()


def test_correction_bias_and_aux_loss_under_expert_parallelism(example_package, tmp_path, monkeypatch):
    """glm4_moe on ep2 (2 processes, gloo): every step's loss, aux loss and correction biases equal one process's."""
    package = _package(example_package("glm4_moe"))
    model = load_runtime(*package, torch.float32)
    apply_lora(model, LORA)
    train(model, _data(model.config.vocab_size), CONFIG, tmp_path / "one", progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(_ep2_worker, args=(port, package, tmp_path / "ep2"), nprocs=2)
    want, got = (read_metrics(tmp_path / name / "metrics.jsonl")[0] for name in ("one", "ep2"))
    assert len(got) == len(want) == CONFIG.steps
    for a, b in zip(got, want):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"] and abs(a["aux_loss"] - b["aux_loss"]) <= 1e-5 * b["aux_loss"]
        assert a["expert_counts"] == b["expert_counts"] and b["correction_bias"]
        for layer, bias in b["correction_bias"].items():
            assert torch.equal(torch.tensor(a["correction_bias"][layer]), torch.tensor(bias)), (a["step"], layer)


def test_train_defaults_are_off(example_spec):
    """Both off unless asked (LoRA keeps the router frozen); `auto` is the release's router_aux_loss_coef; a bias
    rate needs routers with a correction bias."""
    off = dict(aux_loss_coef=0.0, correction_bias_rate=0.0)
    assert balance_options(example_spec("qwen3_moe"), 0.0, 0.0) == off
    assert balance_options(example_spec("glm4_moe"), 0.0, 0.0) == off
    assert balance_options(example_spec("qwen3_moe"), "auto", 0.0) == dict(aux_loss_coef=0.001, correction_bias_rate=0.0)
    assert balance_options(example_spec("glm4_moe"), 0.5, 1e-3) == dict(aux_loss_coef=0.5, correction_bias_rate=1e-3)
    with pytest.raises(OptionGap, match="--bias-update-rate"):
        balance_options(example_spec("qwen3_moe"), 0.0, 1e-3)


def test_a_bias_rate_on_routers_without_a_correction_bias_is_a_gap(example_package, tmp_path, capsys):
    """The release is valid; the option has nothing to act on: exit 3 with one gap line, before any step (the data,
    read and checked first, is fine)."""
    from onboard import cli

    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a few words to train on"}\n' * 4)
    code = cli.main(["train", str(example_package("qwen3_moe")), "--data", str(data),
                     "--bias-update-rate", "1e-3", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 3 and "onboard: gap:" in err and "--bias-update-rate" in err and "no correction bias" in err


def test_a_run_that_updated_biases_saves_them_and_export_says_peft_cannot(example_package, tmp_path):
    """A real `onboard train --bias-update-rate` process (glm4_moe, 2 steps): the adapter folder holds the final
    biases the last step logged; `onboard export --peft` then exits 3 with one line pointing to --merge."""
    data, run = tmp_path / "data.jsonl", tmp_path / "run"
    data.write_text("".join(json.dumps({"text": f"The mill by bridge {i} grinds corn all day."}) + "\n" for i in range(12)))
    cli = [sys.executable, "-m", "onboard.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    trained = subprocess.run([*cli, "train", str(example_package("glm4_moe")), "--data", str(data), "--steps", "2",
                              "--seq-len", "32", "--bias-update-rate", "1e-2", "--out", str(run), "--no-progress"],
                             capture_output=True, text=True, timeout=300, env=env)
    assert trained.returncode == 0, trained.stderr
    last = read_metrics(run / "metrics.jsonl")[0][-1]["correction_bias"]
    saved = read_biases(run)
    assert saved and {f"layers.{layer}.ffn.router.correction_bias" for layer in last} == saved.keys()
    for layer, bias in last.items():
        assert torch.equal(saved[f"layers.{layer}.ffn.router.correction_bias"], torch.tensor(bias))
    exported = subprocess.run([*cli, "export", str(run), "--peft", str(tmp_path / "peft")], capture_output=True,
                              text=True, timeout=300, env=env)
    assert exported.returncode == 3 and "--merge" in exported.stderr and len(exported.stderr.strip().splitlines()) == 1
