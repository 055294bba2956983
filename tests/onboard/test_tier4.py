"""Tier 4 (full scale on paper): the seed example's package made from its index alone passes for the plan
on 128 GPUs; broken weight maps and clusters too small fail the named check."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from onboard.align import run_alignment
from onboard.align.tiers.tier4 import Target, plan_workload, tier4
from onboard.errors import BadInput
from onboard.package.weight_map import build_weight_map
from onboard.package.writer import write_package
from onboard.plan.search import Cluster, Workload
from onboard.recognize.recognizer import recognize
from onboard.release.manifest import read_manifest
from runtime.parallel.placement import MeshShape

WORKLOAD = Workload(seq_len=256, lora_rank=8, micro_batch=1)
# both mesh dimensions above 1, so experts are spread and FSDP-sharded at once
MESH = MeshShape(dp_shard=2, ep=2)


def test_seed_package_from_its_index_passes_tier4(seed_dir, tmp_path):
    pkg, _ = write_package(seed_dir, tmp_path / "seed-pkg", gpu_mem_gib=141, gpus=128)
    plan = yaml.safe_load((pkg / "plan.yaml").read_text())
    assert plan["chosen"] and plan["cluster"]["gpus"] == 128
    report = run_alignment(pkg, [4], cluster=Cluster(128, 141, 8))
    checks = {c.name: c for c in report.tiers[0].checks}
    assert report.passed, [c.detail for c in checks.values() if c.verdict != "pass"]
    assert set(checks) == {"placement/experts_placed_once", "placement/released_tensors_owned_once",
                           "placement/runtime_tensors_filled", "placement/memory_within_capacity",
                           "placement/groups_consistent"}
    memory = checks["placement/memory_within_capacity"]
    assert memory.value == pytest.approx(plan["chosen"]["memory_gib"]["total"], rel=0.01)
    assert json.loads((pkg / "alignment" / "tier4.json").read_text())["passed"]


@pytest.fixture(scope="module")
def tiny(example_release):
    source = example_release("qwen3_moe")
    spec = recognize(read_manifest(source))
    return spec, build_weight_map(spec), source


def _failed(checks) -> set[str]:
    return {c.name for c in checks if c.verdict == "fail"}


def test_tiny_release_passes_on_four_gpus(tiny):
    spec, weight_map, source = tiny
    checks = tier4(spec, weight_map, source, Target(Cluster(4, 80, 8), WORKLOAD))
    assert not _failed(checks) and len(checks) == 5
    assert not _failed(tier4(spec, weight_map, source, Target(Cluster(4, 80, 8), WORKLOAD, MESH)))


def test_an_unmapped_expert_leaves_its_row_unfilled(tiny):
    spec, weight_map, source = tiny
    broken = {name: entry for name, entry in weight_map.items() if not name.endswith("layers.1.mlp.experts.3.down_proj.weight")}
    assert len(broken) == len(weight_map) - 1
    checks = tier4(spec, broken, source, Target(Cluster(4, 80, 8), WORKLOAD, MESH))
    assert _failed(checks) == {"placement/runtime_tensors_filled"}


def test_a_tensor_mapped_nowhere_is_misread(tiny):
    spec, weight_map, source = tiny
    name = next(n for n in weight_map if n.endswith("layers.0.self_attn.q_proj.weight"))
    broken = weight_map | {name: dict(weight_map[name], target="layers.0.attn.no_such.weight")}
    checks = tier4(spec, broken, source, Target(Cluster(4, 80, 8), WORKLOAD, MESH))
    assert "placement/released_tensors_owned_once" in _failed(checks)


def test_nothing_fits_fails_with_the_reason(tiny):
    spec, weight_map, source = tiny
    checks = tier4(spec, weight_map, source, Target(Cluster(2, 0.5, 8), WORKLOAD))
    assert [c.name for c in checks] == ["placement/plan"] and "nothing fits 2 GPUs" in checks[0].detail


def test_tier4_without_a_cluster_is_bad_input(example_package):
    pkg = example_package("qwen3_moe")
    result = subprocess.run([sys.executable, "-m", "onboard.cli", "align", str(pkg), "--tiers", "4"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "--gpus" in result.stderr


def test_a_malformed_plan_yaml_is_bad_input(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("workload: {seq_len: long}\n")
    with pytest.raises(BadInput, match="plan.yaml: workload"):
        plan_workload(path)
