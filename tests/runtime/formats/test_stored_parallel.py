"""Expert parallelism and FSDP over stored weights, in real gloo processes: dp2 x ep2 of a stored package (codes and
scales cut alike on the expert dim, FSDP rows of each on every rank, some ranks holding no scale rows) gives the
one-process loss and LoRA gradients, with the MoE blocks recomputed in backward."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.lora.factors import apply_lora, initial_value
from runtime.memory import MemoryPolicy
from runtime.model.stored import build_stored_model, stored_targets
from runtime.model.weights import load_release
from runtime.parallel.parallelize import ParallelConfig
from runtime.parallel.placement import MeshShape
from runtime.parallel.process import exit_without_teardown, finish
from tests.runtime.test_parallel import LORA, ROWS, _free_port, _loss_and_grads, _start_B


def _worker(rank, world, port, mesh, package, out):
    import runtime.parallel.load as sharded
    from runtime.formats.weight import StoredWeight
    from runtime.parallel.parallelize import device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sharded.initial_value = lambda name, shape, config: (
        _start_B(name, shape) if name.endswith("_B") else initial_value(name, shape, config))
    spec, weight_map, source = package
    plan = ParallelConfig(mesh, MemoryPolicy(recompute=("moe",)))
    model = sharded.build_sharded_model(spec, weight_map, source, LORA, plan, device_mesh(mesh, "cpu"), rank,
                                        torch.device("cpu"), torch.float32)
    assert any(isinstance(m, StoredWeight) for m in model.modules())
    loss, grads = _loss_and_grads(model, [r for r in range(ROWS) if r % world == rank])
    dist.all_reduce(loss)
    if rank == 0:
        torch.save((loss, grads), out)
    # the runtime's own end of a rank (runtime/parallel/process.py): leave the group, then exit without the
    # interpreter's teardown, which a gloo thread's late release can abort
    finish()
    exit_without_teardown()


@pytest.mark.parametrize("family,kind", [("qwen3_moe", "fp8")])
def test_dp2_ep2_stored_equals_one_process(stored_package, family, kind, tmp_path, monkeypatch):
    spec, weight_map, source, _ = stored_package(family, kind)
    model = build_stored_model(spec, stored_targets(weight_map), "cpu", torch.float32)
    load_release(model, source, weight_map)
    apply_lora(model, LORA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_B"):
                p.copy_(_start_B(name, p.shape))
    want_loss, want = _loss_and_grads(model, list(range(ROWS)))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(4, _free_port(), MeshShape(2, 2), (spec, weight_map, source), tmp_path / "out.pt"), nprocs=4)
    loss, got = torch.load(tmp_path / "out.pt")
    assert abs(float(loss - want_loss)) <= 1e-5 * abs(float(want_loss))
    assert got.keys() == want.keys() and any("experts.lora_down_A" in n for n in want)
    for name in want:
        assert want[name].norm() > 0, name
        assert (got[name] - want[name]).norm() <= 1e-5 * want[name].norm(), name
