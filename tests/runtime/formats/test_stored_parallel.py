"""Expert parallelism and FSDP over stored weights, in real gloo processes: dp2 x ep2 of a stored package (codes and
scales cut alike on the expert dim, FSDP rows of each on every rank, some ranks holding no scale rows) gives the
one-process loss and LoRA gradients, with the MoE blocks recomputed in backward."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from runtime.lora.factors import apply_lora
from runtime.model.stored import build_stored_model, stored_targets
from runtime.model.weights import load_release
from runtime.parallel.placement import MeshShape
from tests.runtime.test_parallel import LORA, ROWS, _free_port, _loss_and_grads, _start_B, _worker


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
    mp.spawn(_worker, args=(4, _free_port(), MeshShape(2, 2), (spec, weight_map, source), tmp_path / "out.pt", True),
             nprocs=4)
    loss, got = torch.load(tmp_path / "out.pt")
    assert abs(float(loss - want_loss)) <= 1e-5 * abs(float(want_loss))
    assert got.keys() == want.keys() and any("experts.lora_down_A" in n for n in want)
    for name in want:
        assert want[name].norm() > 0, name
        assert (got[name] - want[name]).norm() <= 1e-5 * want[name].norm(), name
