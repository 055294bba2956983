"""`onboard plan`: the mesh/policy/micro-batch search on the 2.8T seed example (index only) and on tiny
releases, plan.yaml, and the CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import yaml

from onboard.plan.render import plan_yaml
from onboard.plan.search import Cluster, Workload, meshes, search
from onboard.recognize.recognizer import recognize
from onboard.release.manifest import read_manifest

SEED_WORKLOAD = Workload(seq_len=4096, lora_rank=16, micro_batch=None)


def onboard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onboard.cli", *args], capture_output=True, text=True, timeout=300)


def test_seed_on_128_gpus_fits_dp2_ep64(seed_spec):
    plan = search(seed_spec, Cluster(128, 141, 8), SEED_WORKLOAD)
    assert plan.chosen is not None and plan.chosen.fits
    reference = [c for c in plan.candidates if c.mesh == "dp2xep64" and c.fits]
    assert reference and all(c.experts_per_rank == 14 for c in reference)
    m = reference[0].memory
    parts = m.weights + m.lora + m.activations + m.all_to_all + m.all_gather + m.workspace
    assert abs(parts - m.total) < 1e-9 and m.total <= m.capacity
    # 5.2 TB of bf16 weights over 128 ranks: each rank's shard is about a 128th of them
    assert abs(m.weights - seed_spec.params.total * 2 / 128 / 2**30) < 1.0
    assert plan.candidates[0] is plan.chosen
    fitting = [c.time.tokens_per_s for c in plan.candidates if c.fits]
    assert fitting == sorted(fitting, reverse=True)


def test_seed_on_32_gpus_fits_nowhere_and_names_the_smallest_count(seed_spec):
    plan = search(seed_spec, Cluster(32, 141, 8), SEED_WORKLOAD)
    assert plan.chosen is None and not any(c.fits for c in plan.candidates)
    assert "nothing fits 32 GPUs" in plan.reason and "weights" in plan.reason
    smallest = plan.smallest_gpus
    assert smallest and smallest % 8 == 0
    assert search(seed_spec, Cluster(smallest, 141, 8), SEED_WORKLOAD).chosen is not None
    assert search(seed_spec, Cluster(smallest - 8, 141, 8), SEED_WORKLOAD, find_smallest=False).chosen is None


def test_uneven_ep_is_rejected_with_both_numbers(example_release):
    spec = recognize(read_manifest(example_release("qwen3_moe")))
    experts = spec.layers[0].ffn.num_experts
    plan = search(spec, Cluster(6, 80, 8), SEED_WORKLOAD)
    rejected = {c.mesh: c.reason for c in plan.candidates if c.memory is None}
    assert {m for m in map(str, meshes(6)) if experts % int(m.split("ep")[1])} == set(rejected)
    assert all(f"{experts} routed experts" in r and "ep=" in r for r in rejected.values())


def test_policies_trade_memory_for_time(seed_spec):
    plan = search(seed_spec, Cluster(128, 141, 8), Workload(4096, 16, 1), only=None)
    by_policy = {c.policy: c for c in plan.candidates if c.mesh == "dp2xep64"}
    assert by_policy["none"].memory.activations > by_policy["recompute"].memory.activations > by_policy["offload"].memory.activations
    assert by_policy["none"].time.compute < by_policy["recompute"].time.compute


def test_plan_yaml_matches_the_plan(seed_spec):
    plan = search(seed_spec, Cluster(128, 141, 8), SEED_WORKLOAD)
    data = yaml.safe_load(plan_yaml(plan))
    assert data["chosen"]["mesh"] == {"dp_shard": plan.chosen.dp_shard, "ep": plan.chosen.ep}
    assert data["chosen"]["memory_gib"]["total"] == round(plan.chosen.memory.total, 3)
    assert [a["mesh"] for a in data["alternatives"]][0] == plan.chosen.mesh
    assert sorted(a["mesh"] for a in data["alternatives"]) == sorted(map(str, meshes(128)))


def test_cli_plan_json_and_exit_codes(seed_dir, tmp_path):
    out = tmp_path / "plan.yaml"
    found = onboard("plan", str(seed_dir), "--gpus", "128", "--gpu-mem-gib", "141", "--json", "--out", str(out))
    assert found.returncode == 0, found.stderr
    chosen = json.loads(found.stdout)["chosen"]
    assert yaml.safe_load(out.read_text())["chosen"]["mesh"] == {"dp_shard": chosen["dp_shard"], "ep": chosen["ep"]}
    short = onboard("plan", str(seed_dir), "--gpus", "32", "--gpu-mem-gib", "141")
    assert short.returncode == 3, short.stderr
    assert "nothing fits 32 GPUs" in short.stdout and "smallest GPU count that fits" in short.stdout


def test_activations_count_the_sparse_attention_backward_buffers(seed_spec, monkeypatch):
    """The seed's DSA layers: the sparse attention backward's p and ds of one chunk of tokens (two [chunk, heads,
    top-k] buffers) are part of the backward's peak, with the kernel's chunk size."""
    from onboard.gap import budget as memory
    from runtime.ops.dsa import attention

    assert memory.DSA_BWD_CHUNK == attention.BWD_CHUNK_TOKENS
    dsa = [layer.attention for layer in seed_spec.layers if layer.attention.kind == "mla" and layer.attention.indexer]
    assert dsa, "the seed has DSA layers"
    heads, topk = max(a.num_heads for a in dsa), dsa[0].indexer.topk
    assert memory._dsa_backward_workspace(seed_spec, 2, 32768) == 2 * 2 * memory.DSA_BWD_CHUNK * heads * topk
    # a sequence shorter than the chunk and the top-k: buffers of its own length
    assert memory._dsa_backward_workspace(seed_spec, 2, 512) == 2 * 2 * 512 * heads * 512
    # and the per-GPU activations carry them (at 32768 tokens the backward's peak outweighs the loss's logits)
    with_buffers = memory.activations(seed_spec, 32768)
    monkeypatch.setattr(memory, "_dsa_backward_workspace", lambda spec, b, seq_len: 0)
    assert with_buffers - memory.activations(seed_spec, 32768) == 2 * 2 * memory.DSA_BWD_CHUNK * heads * topk


def test_the_planners_linear_attention_chunk_is_the_kernels():
    """The budget and the cost model size the chunked linear-attention tiles by LINEAR_CHUNK; the kernel chunks by
    its CHUNK_SIZE: a kernel change must move both."""
    from onboard.gap.budget import LINEAR_CHUNK
    from runtime.ops.gated_delta import function
    assert LINEAR_CHUNK == function.CHUNK_SIZE
