"""`onboard train PKG --data FILE.jsonl`: read the package and its release, check and pack the data, train.

Reads only the package (spec, weight map, lora.yaml, plan.yaml's memory policy) and the release
folder it names (or --model-dir): weights and tokenizer files. The data is read, checked and
tokenized before the model is built, so a malformed line fails before any step.
torch and the runtime are imported when the command runs, so the other commands start fast.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from onboard.errors import BadInput


class MemoryPlan(BaseModel):
    """plan.yaml's `memory:` section: op kinds to recompute and to offload (runtime/memory.py)."""

    model_config = ConfigDict(extra="forbid")
    recompute: list[str] = []
    offload: list[str] = []


def add_arguments(p: argparse.ArgumentParser, positive_int) -> None:
    p.add_argument("pkg")
    p.add_argument("--data", required=True, help="jsonl of {\"text\": ...} or {\"messages\": [...]}")
    p.add_argument("--steps", type=positive_int, default=100)
    p.add_argument("--seq-len", type=positive_int, default=2048, help="tokens per packed row")
    p.add_argument("--batch-size", type=positive_int, default=1, help="packed rows per micro-batch")
    p.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval-every", type=positive_int, default=50)
    p.add_argument("--checkpoint-every", type=positive_int, default=50)
    p.add_argument("--eval-fraction", type=float, default=0.1, help="documents held out for eval loss")
    p.add_argument("--recompute", default=None, help="op kinds to recompute, e.g. attention,moe (over plan.yaml)")
    p.add_argument("--offload", default=None, help="op kinds whose activations go to host memory (over plan.yaml)")
    p.add_argument("--out", default=None, help="run folder (default: PKG/runs/latest)")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's last complete checkpoint")
    p.add_argument("--model-dir", default=None, help="the release folder, if it moved since new-model")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="run every step eagerly on CUDA (default: replay forward+backward as a CUDA graph where legal)")
    p.add_argument("--nproc", type=positive_int, default=1, help="processes per node (torchrun); gloo on CPU, NCCL on GPU")
    p.add_argument("--ep", type=positive_int, default=1, help="expert-parallel degree (divides the world size)")
    p.add_argument("--capacity-factor", type=float, default=None, help="cap tokens per expert (default dropless)")
    p.add_argument("--aux-loss-coef", type=aux_coef, default=0.0,
                   help="load-balancing loss weight, or auto: the release's router_aux_loss_coef (default off)")
    p.add_argument("--bias-update-rate", type=float, default=0.0,
                   help="routers' correction-bias step per update, e.g. 1e-3 as DeepSeek-V3 (default off)")
    p.add_argument("--nnodes", type=positive_int, default=1, help="nodes (run the same command on each)")
    p.add_argument("--rdzv-endpoint", default=None, help="host:port of the rendezvous, with --nnodes > 1")


def memory_policy(pkg: Path, recompute: str | None, offload: str | None):
    from runtime.memory import MemoryPolicy

    plan_path = pkg / "plan.yaml"
    plan = MemoryPlan()
    if plan_path.exists():
        try:
            plan = MemoryPlan.model_validate((yaml.safe_load(plan_path.read_text()) or {}).get("memory") or {})
        except (yaml.YAMLError, ValidationError, AttributeError) as err:
            raise BadInput(plan_path, "memory", f"expected {{recompute: [kinds], offload: [kinds]}} ({err})") from None
    kinds = lambda flag, planned: tuple(planned if flag is None else [k for k in flag.split(",") if k])  # noqa: E731
    try:
        return MemoryPolicy(kinds(recompute, plan.recompute), kinds(offload, plan.offload))
    except ValueError as err:
        raise BadInput(plan_path, "memory", str(err)) from None


def load_tokenizer(release: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(release, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise BadInput(release, "tokenizer", f"the release's tokenizer files do not load ({err})") from None


def prepare_data(data_path: Path, tokenizer, seq_len: int, eval_fraction: float, seed: int):
    from runtime.data import pack, read_jsonl, split_eval, tokenize
    from runtime.train import TrainData

    documents = tokenize(read_jsonl(data_path), tokenizer)
    try:
        train_docs, eval_docs = split_eval(documents, eval_fraction, seed)
    except ValueError as err:
        raise BadInput(data_path, None, str(err)) from None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return TrainData(pack(train_docs, seq_len, pad), pack(eval_docs, seq_len, pad))


def read_lora(pkg: Path, weight_map: dict):
    """The package's LoRA plan (PKG/lora.yaml) as a runtime LoraConfig."""
    from runtime.lora_file import read_lora_yaml

    path = pkg / "lora.yaml"
    if not path.exists():
        raise BadInput(path, None, "missing: the package has no LoRA plan (rerun `onboard new-model`)")
    return read_lora_yaml(path, weight_map)


def build_model(spec: dict, weight_map: dict, release: Path, lora_config, policy, device):
    """The runtime model: bf16 base weights from the release, fp32 LoRA factors, the memory policy."""
    import torch

    from runtime.lora import apply_lora
    from runtime.memory import apply_memory_policy
    from runtime.model import HybridDecoder
    from runtime.weights import load_release

    with torch.device(device):
        model = HybridDecoder(spec).to(torch.bfloat16)
    vision = spec["naming"].get("vision_prefix")
    load_release(model, release, weight_map, skip_prefixes=(vision,) if vision else ())
    apply_lora(model, lora_config)
    apply_memory_policy(model, policy)
    return model


def aux_coef(text: str) -> float | str:
    return text if text == "auto" else float(text)


class OptionGap(Exception):
    """A train option this valid release gives nothing to act on: exit 3 with one gap line, not bad input."""


def balance_options(spec: dict, aux_loss_coef: float | str, bias_rate: float) -> dict:
    """TrainConfig's load-balancing fields from the flags. Both default off: LoRA fine-tuning keeps the router
    frozen (transformers adds the aux loss only with output_router_logits=True). `auto` takes the release's
    aux-loss coefficient; a bias rate needs routers with a correction bias."""
    routers = [layer["ffn"]["router"] for layer in spec["layers"] if layer["ffn"].get("kind") == "moe"]
    if aux_loss_coef == "auto":
        aux_loss_coef = next((r["aux_loss_coef"] for r in routers if r.get("aux_loss_coef")), 0.0)
    if bias_rate and not any(r.get("correction_bias") for r in routers):
        raise OptionGap("--bias-update-rate: the release's routers have no correction bias to update")
    return dict(aux_loss_coef=aux_loss_coef, correction_bias_rate=bias_rate)


def _check_ep(ep: int, world: int) -> None:
    if world % ep:
        raise BadInput(None, "--ep", f"{ep} does not divide the world size {world}")


def _plan(args, world: int, policy):
    from runtime.parallel.parallelize import ParallelPlan
    from runtime.parallel.placement import MeshShape

    _check_ep(args.ep, world)
    return ParallelPlan(MeshShape(world // args.ep, args.ep), policy, args.capacity_factor)


def build_parallel_model(spec: dict, weight_map: dict, release: Path, lora_config, plan, rank: int, device):
    """This rank's part of the runtime model, parallelized by `plan` (runtime/parallel/)."""
    import torch

    from runtime.parallel.load import build_sharded_model
    from runtime.parallel.parallelize import device_mesh

    vision = spec["naming"].get("vision_prefix")
    return build_sharded_model(spec, weight_map, release, lora_config, plan, device_mesh(plan.mesh, device.type),
                               rank, device, torch.bfloat16, skip_prefixes=(vision,) if vision else ())


def run(args) -> int:
    """0 trained; 1 aborted (non-finite steps, or a failed rank); 3 the release's chat template cannot mask
    assistant turns, or --bias-update-rate on routers without a correction bias. With --nproc > 1 (outside torchrun) the job is relaunched under torchrun."""
    if (args.nproc > 1 or args.nnodes > 1) and "LOCAL_RANK" not in os.environ:
        from onboard.launch import launch

        _check_ep(args.ep, args.nproc * args.nnodes)
        return launch(_parser(), args)
    return _train(args)


def _train(args) -> int:
    import dataclasses

    from runtime import balance
    from runtime.data import ChatTemplateError
    from runtime.parallel.process import finish, full_lora_state_dict, is_main, start
    from runtime.run_folder import save_adapter, write_run_json
    from runtime.train import TrainConfig, TrainingAborted, train

    pkg = Path(args.pkg)
    spec, weight_map, release = _read_package(pkg, Path(args.model_dir) if args.model_dir else None)
    policy = memory_policy(pkg, args.recompute, args.offload)
    try:
        balancing = balance_options(spec, args.aux_loss_coef, args.bias_update_rate)
    except OptionGap as gap:
        print(f"onboard: gap: {release}: {gap}", file=sys.stderr)
        return 3
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                      warmup_steps=min(10, max(1, args.steps // 10)), eval_every=args.eval_every,
                      checkpoint_every=args.checkpoint_every, cuda_graph=not args.no_cuda_graph, **balancing)
    try:
        data = prepare_data(Path(args.data), load_tokenizer(release), args.seq_len, args.eval_fraction, cfg.seed)
    except ChatTemplateError as err:
        print(f"onboard: gap: {release}: chat template: {err}", file=sys.stderr)
        return 3
    rank, world, device = start()
    lora_config = read_lora(pkg, weight_map)
    if world == 1:
        model = build_model(spec, weight_map, release, lora_config, policy, device)
    else:
        model = build_parallel_model(spec, weight_map, release, lora_config, _plan(args, world, policy), rank, device)
    out = Path(args.out) if args.out else pkg / "runs" / "latest"
    if is_main():
        write_run_json(out, pkg, release, train=dataclasses.asdict(cfg), seq_len=args.seq_len, data=str(args.data),
                       memory=dataclasses.asdict(policy))
    try:
        state = train(model, data, cfg, out, resume=args.resume, progress=not args.no_progress and is_main())
    except TrainingAborted as err:
        print(f"onboard: error: {err}", file=sys.stderr)
        return 1
    factors = full_lora_state_dict(model)
    if is_main():
        # updated biases go beside the factors: export needs them to reproduce the run
        save_adapter(out, factors, lora_config, balance.bias_state_dict(model) if cfg.correction_bias_rate else None)
        print(f"trained {state['step']} steps into {out}; eval loss {state['eval_loss']:.4f}, "
              f"best {state['best_eval_loss']:.4f} at step {state['best_step']}")
    finish()
    return 0


def _read_package(pkg: Path, model_dir: Path | None) -> tuple[dict, dict, Path]:
    """(spec, weight map, release folder) of a package written by `onboard new-model`; the release is
    --model-dir, else the folder package.yaml names (relative to PKG, else absolute). Its generated ops
    (PKG/ops/) are registered into the runtime, so training runs the code validation accepted."""
    from onboard.align.package_files import read_source, release_folder
    from runtime.package_ops import load_package_ops

    release = release_folder(pkg, read_source(pkg), model_dir)
    try:
        spec = json.loads((pkg / "spec.json").read_text())
        weight_map = json.loads((pkg / "weight_map.json").read_text())
    except (OSError, ValueError) as err:
        raise BadInput(pkg, None, f"not a package written by `onboard new-model` ({err})") from None
    load_package_ops(pkg)
    return spec, weight_map, release


def _parser() -> argparse.ArgumentParser:
    from onboard.cli import _positive_int

    parser = argparse.ArgumentParser(prog="onboard train")
    add_arguments(parser, _positive_int)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The trainer module torchrun runs on every rank: `torchrun --nproc-per-node N -m onboard.train_cli PKG ...`."""
    from onboard.cli import EXIT_BAD_INPUT
    from runtime.errors import InputFileError

    args = _parser().parse_args(argv)
    try:
        return _train(args)
    except (BadInput, InputFileError) as err:
        print(f"onboard: error: {err.one_line()}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    # record: torchrun's summary shows a failed rank's traceback
    from torch.distributed.elastic.multiprocessing.errors import record

    code = record(main)()
    if code == 0 and "LOCAL_RANK" in os.environ:
        from runtime.parallel.process import exit_without_teardown

        exit_without_teardown()
    sys.exit(code)
