"""`onboard train PKG --data FILE.jsonl`: read the package and its release, check and pack the data, train.

Reads only the package, through the one package reader (onboard/package/reader.py: refused exactly where
`align` refuses it), and the release folder it names (or --model-dir): weights and tokenizer files. The
model is built by onboard/package/trainer_build.py. The data is read, checked and tokenized before the model is
built, so a malformed line fails before any step. The run folder (default PKG/runs/latest) is made inside
the package without following a symlink, and one being resumed may hold none. torch and the runtime are
imported when the command runs, so the other commands start fast.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from onboard.commands.args import positive_int
from onboard.errors import BadInput
from onboard.exit_codes import Exit


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    from runtime.parallel.parallelize import ParallelConfig
    from runtime.parallel.placement import MeshShape

    _check_ep(args.ep, world)
    return ParallelConfig(MeshShape(world // args.ep, args.ep), policy, args.capacity_factor)


def run(args) -> Exit:
    """0 trained; 1 aborted (non-finite steps, or a failed rank); 3 the release's chat template cannot mask
    assistant turns, --bias-update-rate on routers without a correction bias, or a part of the model nothing here
    computes (a missing op of the gap report). With --nproc > 1 (outside torchrun) the job is relaunched under torchrun."""
    from onboard.package.approved_ops import require_approved

    # the package's op files run in this process (and every rank's): refused before anything else runs
    require_approved(Path(args.pkg))
    if (args.nproc > 1 or args.nnodes > 1) and "LOCAL_RANK" not in os.environ:
        from onboard.commands.train_launch import launch

        _check_ep(args.ep, args.nproc * args.nnodes)
        return launch(_parser(), args)
    return _train(args)


def _train(args) -> Exit:
    import dataclasses

    from onboard.package.approved_ops import approved_hashes
    from onboard.package.reader import read_package
    from onboard.package.trainer_build import build_model, build_parallel_model, load_tokenizer, memory_policy_for, prepare_data
    from onboard.recognize.model_references import package_references
    from runtime.package_ops import arm_spot_checks, load_package_ops
    from runtime.parallel.process import finish, full_lora_state_dict, is_main, start
    from runtime.train import balance
    from runtime.train.data import ChatTemplateError
    from runtime.train.loop import TrainConfig, TrainingAborted, train
    from runtime.train.run_folder import save_adapter, write_run_json

    pkg = Path(args.pkg)
    package = read_package(pkg, Path(args.model_dir) if args.model_dir else None)
    load_package_ops(pkg, approved_hashes())
    # judged with the package's generated ops registered: an op they close is no longer missing
    missing = untrainable(package.spec)
    if missing:
        print(f"onboard: gap: {pkg}: cannot train: {missing}", file=sys.stderr)
        return Exit.GAPS
    # each generated op compares its first call (the first step's real inputs) with the model's own function
    arm_spot_checks(package_references(pkg))
    spec, weight_map, release = package.spec, package.weight_map, package.source
    policy = memory_policy_for(package.memory, args.recompute, args.offload, pkg / "plan.yaml")
    out = run_folder(pkg, args.out)
    try:
        balancing = balance_options(spec, args.aux_loss_coef, args.bias_update_rate)
    except OptionGap as gap:
        print(f"onboard: gap: {release}: {gap}", file=sys.stderr)
        return Exit.GAPS
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                      warmup_steps=min(10, max(1, args.steps // 10)), eval_every=args.eval_every,
                      checkpoint_every=args.checkpoint_every, cuda_graph=not args.no_cuda_graph, **balancing)
    try:
        data = prepare_data(Path(args.data), load_tokenizer(release), args.seq_len, args.eval_fraction, cfg.seed)
    except ChatTemplateError as err:
        print(f"onboard: gap: {release}: chat template: {err}", file=sys.stderr)
        return Exit.GAPS
    rank, world, device = start()
    lora_config = package.lora
    if world == 1:
        model = build_model(spec, weight_map, release, lora_config, policy, device)
    else:
        model = build_parallel_model(spec, weight_map, release, lora_config, _plan(args, world, policy), rank, device)
    if is_main():
        write_run_json(out, pkg, release, train=dataclasses.asdict(cfg), seq_len=args.seq_len, data=str(args.data),
                       memory=dataclasses.asdict(policy))
    try:
        state = train(model, data, cfg, out, resume=args.resume, progress=not args.no_progress and is_main())
    except TrainingAborted as err:
        print(f"onboard: error: {err}", file=sys.stderr)
        return Exit.BUG
    factors = full_lora_state_dict(model)
    if is_main():
        # updated biases go beside the factors: export needs them to reproduce the run
        save_adapter(out, factors, lora_config, balance.bias_state_dict(model) if cfg.correction_bias_rate else None)
        print(f"trained {state['step']} steps into {out}; eval loss {state['eval_loss']:.4f}, "
              f"best {state['best_eval_loss']:.4f} at step {state['best_step']}")
    finish()
    return Exit.OK


def untrainable(spec: dict) -> str | None:
    """Why the package's model cannot be built: the gap report's missing parts (nothing here computes them: a
    runtime op that does not compute their parameters, or an own module of a family transformers does not know);
    None when every part has something to run it."""
    from onboard.gap.report import op_gaps
    from runtime.spec import ModelSpec

    missing = [gap for gap in op_gaps(ModelSpec.model_validate(spec)) if gap.status == "missing"]
    return "; ".join(f"{gap.op} in {len(gap.layers)} layer(s): {gap.detail}" for gap in missing) or None


def run_folder(pkg: Path, out: str | None) -> Path:
    """--out, else PKG/runs/latest made inside the package with no symlink on the way; either way a folder
    holding no symlink, so the trainer's writes stay inside it."""
    from onboard import package_io

    folder = Path(out) if out else pkg / "runs" / "latest"
    if out is None:
        package_io.check_folder(pkg, folder)
    if folder.is_symlink():
        raise BadInput(folder, None, "a symlink: the run folder must be a folder `onboard train` writes into itself")
    if folder.is_dir():
        package_io.refuse_links_below(folder)
    return folder


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onboard train")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> Exit:
    """The trainer module torchrun runs on every rank: `torchrun --nproc-per-node N -m onboard.commands.train PKG ...`."""
    from onboard.commands.refusals import REFUSALS, refusal_exit

    args = _parser().parse_args(argv)
    try:
        return _train(args)
    except REFUSALS as err:
        return refusal_exit(err)


if __name__ == "__main__":
    # record: torchrun's summary shows a failed rank's traceback
    from torch.distributed.elastic.multiprocessing.errors import record

    code = record(main)()
    if code == Exit.OK and "LOCAL_RANK" in os.environ:
        from runtime.parallel.process import exit_without_teardown

        exit_without_teardown()
    sys.exit(code)
