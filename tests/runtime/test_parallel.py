"""The distributed runtime on CPU with gloo, in real processes (torch.multiprocessing spawn): expert-parallel
dispatch and FSDP2 give the one-process loss and LoRA gradients; tier 3 (world 1, 2, 4 and the ep-resize
resume); capacity dropping; the uneven-experts error; `onboard train --nproc` and a failed rank under torchrun."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from onboard.align.tiers.tier3 import tier3
from runtime.lora.factors import LoraConfig, apply_lora, initial_value
from runtime.memory import MemoryPolicy
from runtime.model.decoder import HybridDecoder
from runtime.model.weights import load_release
from runtime.ops.moe.torch_form import sort_by_expert
from runtime.parallel.expert_parallel import _capacity
from runtime.parallel.parallelize import ParallelConfig, parallelize
from runtime.parallel.placement import MeshShape, PlacementError
from runtime.spec import read_spec
from runtime.train.loop import loss_sum
from runtime.train.metrics import read_metrics
from runtime.parallel.process import exit_without_teardown, finish

LORA = LoraConfig(rank=4, alpha=8, targets=("layers.*.attn.q_proj",), experts=True)
ROWS, T = 4, 32


def _package(pkg: Path) -> tuple[dict, dict, Path]:
    source = Path(yaml.safe_load((pkg / "package.yaml").read_text())["source"]["absolute"])
    return json.loads((pkg / "spec.json").read_text()), json.loads((pkg / "weight_map.json").read_text()), source


def _batch(rows: list[int]) -> dict:
    ids = torch.randint(3, 250, (ROWS, T), generator=torch.Generator().manual_seed(1))[rows].reshape(1, -1)
    return {"input_ids": ids, "labels": torch.cat([ids[0, 1:], torch.tensor([-100])]),
            "positions": torch.arange(ids.shape[1])[None] % T,
            "cu_seqlens": torch.arange(0, ids.shape[1] + 1, T, dtype=torch.int32)}


def _start_B(name: str, shape) -> torch.Tensor:
    """Non-zero B factors, so that the A factors' gradients are not zero on both sides."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.05


def _loss_and_grads(model, rows: list[int]) -> tuple[torch.Tensor, dict]:
    tokens = sum((_batch([r])["labels"] != -100).sum() for r in range(ROWS))
    loss = sum(loss_sum(model, _batch([r]), 1024) for r in rows) / tokens
    loss.backward()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def _worker(rank, world, port, mesh, package, out, stored: bool = False):
    """One rank of an ep/dp step with MoE recompute; `stored`: the model must hold stored base weights."""
    import runtime.parallel.load as sharded
    from runtime.parallel.parallelize import device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sharded.initial_value = lambda name, shape, config: (
        _start_B(name, shape) if name.endswith("_B") else initial_value(name, shape, config))
    spec, weight_map, source = package
    # recompute of the MoE blocks: the dispatch's all_to_all runs again in backward
    plan = ParallelConfig(mesh, MemoryPolicy(recompute=("moe",)))
    model = sharded.build_sharded_model(spec, weight_map, source, LORA, plan,
                                        device_mesh(mesh, "cpu"), rank, torch.device("cpu"), torch.float32)
    if stored:
        from runtime.formats.weight import StoredWeight

        assert any(isinstance(m, StoredWeight) for m in model.modules())
    loss, grads = _loss_and_grads(model, [r for r in range(ROWS) if r % world == rank])
    dist.all_reduce(loss)
    if rank == 0:
        torch.save((loss, grads), out)
    # the runtime's own end of a rank (runtime/parallel/process.py): leave the group, then exit without the
    # interpreter's teardown, which a gloo thread's late release can abort
    finish()
    exit_without_teardown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_expert_parallel_step_equals_one_process(example_package, tmp_path, monkeypatch):
    """ep2 over 2 processes with MoE recompute: loss and every LoRA gradient (A factors included: B starts
    non-zero) vs one process."""
    package = _package(example_package("qwen3_moe"))
    spec, weight_map, source = package
    model = HybridDecoder(spec).float()
    load_release(model, source, weight_map)
    apply_lora(model, LORA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_B"):
                p.copy_(_start_B(name, p.shape))
    want_loss, want = _loss_and_grads(model, list(range(ROWS)))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(2, _free_port(), MeshShape(1, 2), package, tmp_path / "out.pt"), nprocs=2)
    loss, got = torch.load(tmp_path / "out.pt")
    assert abs(float(loss - want_loss)) <= 1e-5 * abs(float(want_loss))
    assert got.keys() == want.keys() and any("experts.lora_down_A" in n for n in want)
    for name in want:
        assert want[name].norm() > 0, name
        assert (got[name] - want[name]).norm() <= 1e-5 * want[name].norm(), name


def test_tier3_passes(example_package):
    """World 1, 2, 4 (dp2, ep2, ep4, dp2 x ep2), 4 steps, every step's gradients, the ep2 checkpoint resumed at ep1
    and ep4, ep2 and ep4 with the aux loss."""
    spec, weight_map, source = _package(example_package("qwen3_moe"))
    checks = tier3(read_spec(spec), weight_map, source, example_package("qwen3_moe") / "lora.yaml")
    failed = [(c.name, c.value) for c in checks if c.verdict != "pass"]
    assert not failed
    names = {c.name for c in checks}
    assert {"dp2xep2/step4/loss", "dp1xep4/step4/lora_grads", "resume-ep4/step4/loss", "resume-ep1/step3/loss",
            "dp1xep4-balance/step4/aux_loss", "dp1xep2-balance/step4/lora_grads"} <= names


def test_capacity_drops_the_latest_pairs_of_an_overfull_expert():
    # 6 tokens, k = 1, 3 experts: expert 0 gets 4 pairs, expert 1 two, expert 2 none; capacity ceil(1.0 * 6 / 3) = 2
    idx_Tk = torch.tensor([[0], [1], [0], [0], [1], [0]])
    keep_S, kept_E = _capacity(sort_by_expert(idx_Tk, 3), 3, 1.0, 6)
    assert kept_E.tolist() == [2, 2, 0]
    sort = sort_by_expert(idx_Tk, 3)
    assert sorted(sort.token_S[~keep_S].tolist()) == [3, 5]
    keep_all, counts_E = _capacity(sort, 3, None, 6)
    assert bool(keep_all.all()) and counts_E.tolist() == [4, 2, 0]


def test_experts_not_divisible_by_ep_is_refused(example_spec):
    model = HybridDecoder(example_spec("qwen3_moe"))
    with pytest.raises(PlacementError, match=r"\b8\b.*ep=3"):
        parallelize(model, None, ParallelConfig(MeshShape(1, 3)))


def _train_args(package: Path, data: Path, out: Path) -> list[str]:
    return [str(package), "--data", str(data), "--steps", "2", "--seq-len", "32", "--out", str(out), "--no-progress",
            "--checkpoint-every", "1", "--eval-every", "2"]


def _data(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": f"The river runs past mill number {i} under the bridge."}) + "\n"
                            for i in range(8)))
    return path


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def test_onboard_train_nproc_runs_torchrun(example_package, tmp_path):
    """`onboard train --nproc 2 --ep 2` with a capacity factor: adapter written, per-expert counts summed over
    ranks, drops counted."""
    package = example_package("qwen3_moe")
    out = tmp_path / "run"
    done = _run([sys.executable, "-m", "onboard.cli", "train", *_train_args(package, _data(tmp_path / "d.jsonl"), out),
                 "--nproc", "2", "--ep", "2", "--capacity-factor", "1.0"])
    assert done.returncode == 0, done.stderr[-3000:]
    # rank 0's summary line survives its exit without the interpreter's teardown (flushed first)
    assert f"trained 2 steps into {out}" in done.stdout
    assert (out / "adapter").is_dir() and [p.name for p in (out / "checkpoints").iterdir()] != []
    top_k = json.loads((package / "spec.json").read_text())["layers"][0]["ffn"]["top_k"]
    for record in read_metrics(out / "metrics.jsonl")[0]:
        for layer, counts in record["expert_counts"].items():
            assert sum(counts) == record["tokens"] * top_k
            assert 0 < record["expert_drop_rate"][layer] < 1
            assert record["expert_imbalance"][layer] >= 1


def test_a_failed_rank_ends_the_job_and_commits_no_checkpoint(example_package, tmp_path):
    out = tmp_path / "run"
    done = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                 "-m", "tests.runtime.rank_failure", *_train_args(example_package("qwen3_moe"),
                                                                  _data(tmp_path / "d.jsonl"), out), "--ep", "2"])
    assert done.returncode != 0
    assert "injected failure on rank 1 while saving" in done.stderr
    assert not list((out / "checkpoints").glob("step-*"))
