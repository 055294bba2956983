"""The trainer's model, built from a read package: what `train`, `bench` and the tests share, below the commands.

bf16 base weights from the release (runtime/model/weights.py), fp32 LoRA factors from lora.yaml, plan.yaml's memory
policy (or the --recompute / --offload flags over it); on one process the whole model, on several this
rank's part of it parallelized by the plan (runtime/parallel/). torch and the runtime are imported when a
function runs, so the commands that never build a model start fast.
"""
from __future__ import annotations

from pathlib import Path

from onboard.errors import BadInput
from onboard.package.reader import MemoryPlan, read_lora_plan, read_memory_plan


def memory_policy_for(plan: MemoryPlan, recompute: str | None, offload: str | None, plan_path: Path):
    """plan.yaml's memory section, each flag (a comma list of op kinds) replacing its half when given."""
    from runtime.memory import MemoryPolicy

    kinds = lambda flag, planned: tuple(planned if flag is None else [k for k in flag.split(",") if k])  # noqa: E731
    try:
        return MemoryPolicy(kinds(recompute, plan.recompute), kinds(offload, plan.offload))
    except ValueError as err:
        raise BadInput(plan_path, "memory", str(err)) from None


def memory_policy(pkg: Path, recompute: str | None, offload: str | None):
    """The memory policy of the package at `pkg` (plan.yaml read through the package reader)."""
    return memory_policy_for(read_memory_plan(Path(pkg)), recompute, offload, Path(pkg) / "plan.yaml")


def read_lora(pkg: Path, weight_map: dict):
    """The package's LoRA plan (PKG/lora.yaml) as a runtime LoraConfig."""
    return read_lora_plan(Path(pkg), weight_map)


def build_model(spec: dict, weight_map: dict, release: Path, lora_config, policy, device):
    """The runtime model: bf16 base weights from the release (those it stores quantized kept so: codes and scales,
    runtime/formats/), fp32 LoRA factors, the memory policy."""
    import torch

    from runtime.lora.factors import apply_lora
    from runtime.memory import apply_memory_policy
    from runtime.model.decoder import HybridDecoder
    from runtime.model.stored import build_stored_model, stored_targets
    from runtime.model.weights import load_release

    stored = stored_targets(weight_map)
    if stored:
        # built on the meta device: the stored weights are allocated as codes and scales only
        model = build_stored_model(spec, stored, device)
    else:
        with torch.device(device):
            model = HybridDecoder(spec).to(torch.bfloat16)
    vision = spec["naming"].get("vision_prefix")
    load_release(model, release, weight_map, skip_prefixes=(vision,) if vision else ())
    apply_lora(model, lora_config)
    apply_memory_policy(model, policy)
    return model


def build_parallel_model(spec: dict, weight_map: dict, release: Path, lora_config, plan, rank: int, device):
    """This rank's part of the runtime model, parallelized by `plan` (runtime/parallel/)."""
    import torch

    from runtime.parallel.load import build_sharded_model
    from runtime.parallel.parallelize import device_mesh

    vision = spec["naming"].get("vision_prefix")
    return build_sharded_model(spec, weight_map, release, lora_config, plan, device_mesh(plan.mesh, device.type),
                               rank, device, torch.bfloat16, skip_prefixes=(vision,) if vision else ())


def load_tokenizer(release: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(release, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise BadInput(release, "tokenizer", f"the release's tokenizer files do not load ({err})") from None


def prepare_data(data_path: Path, tokenizer, seq_len: int, eval_fraction: float, seed: int):
    """Read, check and pack the data before the model is built, so a malformed line fails before any step."""
    from runtime.train.data import pack, read_jsonl, split_eval, tokenize
    from runtime.train.loop import TrainData

    documents = tokenize(read_jsonl(data_path), tokenizer)
    try:
        train_docs, eval_docs = split_eval(documents, eval_fraction, seed)
    except ValueError as err:
        raise BadInput(data_path, None, str(err)) from None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return TrainData(pack(train_docs, seq_len, pad), pack(eval_docs, seq_len, pad))
