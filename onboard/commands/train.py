"""`onboard train PKG --data PATH`: check the data, read the package and its release, pack the data, train.

Reads only the package, through the one package reader (onboard/package/reader.py: refused exactly where
`align` refuses it), and the release folder it names (or --model-dir): weights and tokenizer files. The
model is built by onboard/package/trainer_build.py. Every flag is checked first, then every data record is read and
checked (runtime/data/) before torch or the package loads, and tokenized before the model is built, so a malformed
line fails at once. A run folder holds one run (onboard/commands/training/run_choice.py: a new PKG/runs/<start
time> by default, an existing --out only with --resume, which refuses changed settings that change the math); it is
made inside the package without following a symlink, and one being resumed may hold none. `--config FILE` takes
every flag as a key (onboard/commands/training/config_file.py). torch and the runtime are imported when the command
runs, so the other commands start fast.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from onboard.commands.args import (DefaultsFormatter, OnboardParser, non_negative_float, non_negative_int,
                                   open_fraction, positive_float, positive_int)
from onboard.commands.training.config_file import config_yaml, expand_config, resolved_config
from onboard.commands.training.run_choice import (check_resume, choose_folder, data_digest, last_checkpoint_step,
                                                  recorded_math, require_fresh)
from onboard.commands.training.status import NotTrainable, require_trainable
from onboard.errors import BadInput
from onboard.exit_codes import Exit
from runtime.data.formats import FORMATS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pkg", help="the package folder `onboard new-model` wrote")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="YAML of flag: value (every flag below, e.g. seq_len: 2048); flags given here override it")
    p.add_argument("--print-config", action="store_true", help="print the resolved config (YAML) and exit")
    p.add_argument("--data", required=True, help="a jsonl, JSON-array, parquet or Arrow file, or a folder of them "
                                                 "(docs/training.md#data)")
    p.add_argument("--data-format", choices=("auto", *FORMATS), default="auto",
                   help="the records' format (default: detected per record from its keys)")
    evaluation = p.add_mutually_exclusive_group()
    evaluation.add_argument("--eval-data", default=None, help="eval records (default: a folder's eval split, else "
                                                              "--eval-fraction of --data)")
    evaluation.add_argument("--no-eval", action="store_true", help="no eval loss (and no best checkpoint)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=positive_int, default=100, help="optimizer steps")
    length.add_argument("--epochs", type=positive_float, default=None,
                        help="passes over the training rows, instead of --steps")
    p.add_argument("--seq-len", type=positive_int, default=2048, help="tokens per packed row")
    p.add_argument("--batch-size", type=positive_int, default=1, help="packed rows per micro-batch")
    p.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=positive_float, default=1e-4, help="peak learning rate")
    p.add_argument("--warmup-steps", type=non_negative_int, default=None,
                   help="linear warmup steps (default min(10, max(1, steps // 10)); on --resume the run's own)")
    p.add_argument("--weight-decay", type=non_negative_float, default=0.0, help="AdamW weight decay on the factors")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="data order and the held-out draw (the factors' init seed is lora.yaml's)")
    p.add_argument("--eval-every", type=positive_int, default=50, help="steps between eval losses")
    p.add_argument("--checkpoint-every", type=positive_int, default=50, help="steps between checkpoints")
    p.add_argument("--eval-fraction", type=open_fraction, default=0.1, help="documents held out for eval loss")
    p.add_argument("--recompute", default=None, help="op kinds to recompute, e.g. attention,moe (over plan.yaml)")
    p.add_argument("--offload", default=None, help="op kinds whose activations go to host memory (over plan.yaml)")
    p.add_argument("--out", default=None,
                   help="run folder (default: a new PKG/runs/YYYYMMDD-HHMMSS; with --resume the newest there)")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's last complete checkpoint")
    p.add_argument("--model-dir", default=None, help="the release folder, if it moved since new-model")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    p.add_argument("--tensorboard", action="store_true", help="also write TensorBoard event files to RUN/tensorboard")
    p.add_argument("--wandb", default=None, metavar="PROJECT",
                   help="also log to this Weights & Biases project (WANDB_MODE=offline: files under RUN/wandb)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="run every step eagerly on CUDA (default: replay forward+backward as a CUDA graph where legal)")
    p.add_argument("--nproc", type=positive_int, default=1, help="processes per node (torchrun); gloo on CPU, NCCL on GPU")
    p.add_argument("--ep", type=positive_int, default=1, help="expert-parallel degree (divides the world size)")
    p.add_argument("--capacity-factor", type=positive_float, default=None,
                   help="cap tokens per expert (default dropless)")
    p.add_argument("--aux-loss-coef", type=aux_coef, default=0.0,
                   help="load-balancing loss weight, or auto: the release's router_aux_loss_coef (default off)")
    p.add_argument("--bias-update-rate", type=non_negative_float, default=0.0,
                   help="routers' correction-bias step per update, e.g. 1e-3 as DeepSeek-V3 (default off)")
    p.add_argument("--nnodes", type=positive_int, default=1, help="nodes (run the same command on each)")
    p.add_argument("--rdzv-endpoint", default=None, help="host:port of the rendezvous, with --nnodes > 1")


def aux_coef(text: str) -> float | str:
    return text if text == "auto" else non_negative_float(text)


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
    """0 trained (or --print-config); 1 aborted (non-finite steps, or a failed rank); 2 a bad flag, data line or run
    folder (one taken without --resume, a resume that changes the math); 3 a package new-model did not leave
    trainable or whose model has a part nothing here computes, the release's chat template cannot mask assistant turns, or --bias-update-rate on routers without a
    correction bias. With --nproc > 1 (outside torchrun) the job is relaunched under torchrun."""
    from onboard.package.approved_ops import require_approved

    check_flags(args)
    if args.print_config:
        print(config_yaml(resolved_config(resolved_warmup(args), parser())), end="")
        return Exit.OK
    # every record checked next: a malformed line is refused in a second, before torch or the package loads
    sources = read_data(args)
    # the package's op files run in this process (and every rank's): refused before anything else runs
    require_approved(Path(args.pkg))
    try:
        require_trainable(Path(args.pkg))
    except NotTrainable as gap:
        print(f"onboard: gap: {gap}", file=sys.stderr)
        return Exit.GAPS
    if (args.nproc > 1 or args.nnodes > 1) and "LOCAL_RANK" not in os.environ:
        from onboard.commands.train_launch import launch

        # named once here: ranks picking a new folder by their own clock could pick different ones
        args.out = str(choose_folder(Path(args.pkg), args.out, args.resume))
        return launch(parser(), args)
    return _train(args, sources)


def read_data(args):
    """--data (and --eval-data) read and checked record by record: runtime/data/."""
    from runtime.data.sources import read_sources

    return read_sources(Path(args.data), args.data_format, Path(args.eval_data) if args.eval_data else None,
                        args.no_eval)


def epoch_steps(epochs: float, num_rows: int, rows_per_step: int) -> int:
    """Optimizer steps for `epochs` passes over the training rows (every rank reads its own rows of a step)."""
    return max(1, math.ceil(epochs * num_rows / rows_per_step))


def check_flags(args) -> None:
    """What argparse's per-flag types cannot see: flags that only make sense together, and optional packages."""
    from runtime.train.sinks import available

    # under torchrun the launch flags were left out of each rank's command line: the world is torchrun's
    world = int(os.environ["WORLD_SIZE"]) if "LOCAL_RANK" in os.environ else args.nproc * args.nnodes
    _check_ep(args.ep, world)
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise BadInput(None, "--rdzv-endpoint", "needed with --nnodes > 1: host:port of the c10d rendezvous")
    # every rank writes the same run folder: one a node or rank named by its own clock could differ
    if (args.nnodes > 1 or "LOCAL_RANK" in os.environ) and args.out is None:
        raise BadInput(None, "--out", "needed with --nnodes > 1 or under torchrun: the run folder every rank writes")
    if args.tensorboard and not available("tensorboard"):
        raise BadInput(None, "--tensorboard", "the tensorboard package is not installed (pip install 'onboard[logging]')")
    if args.wandb is not None and not args.wandb.strip():
        raise BadInput(None, "--wandb", "expected a project name")
    if args.wandb and not available("wandb"):
        raise BadInput(None, "--wandb", "the wandb package is not installed (pip install 'onboard[logging]')")


def resolved_warmup(args, recorded: int | None = None):
    """args with --warmup-steps resolved: the flag, else the resumed run's own, else min(10, max(1, steps // 10))."""
    if args.warmup_steps is None:
        args.warmup_steps = recorded if recorded is not None else min(10, max(1, args.steps // 10))
    return args


def _train(args, sources=None) -> Exit:
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
    out = choose_folder(pkg, args.out, args.resume)
    # before the data is read: a taken folder, or a resume of nothing, is refused at once
    if args.resume:
        recorded_math(out)
    else:
        require_fresh(out)
    warmup_given = args.warmup_steps is not None
    resolved_warmup(args, recorded_setting(out, "warmup_steps") if args.resume else None)
    try:
        balancing = balance_options(spec, args.aux_loss_coef, args.bias_update_rate)
    except OptionGap as gap:
        print(f"onboard: gap: {release}: {gap}", file=sys.stderr)
        return Exit.GAPS
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                      warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, seed=args.seed,
                      eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
                      cuda_graph=not args.no_cuda_graph, **balancing)
    try:
        data = prepare_data(sources or read_data(args), load_tokenizer(release), args.seq_len, args.eval_fraction,
                            cfg.seed)
    except ChatTemplateError as err:
        print(f"onboard: gap: {release}: chat template: {err}", file=sys.stderr)
        return Exit.GAPS
    rank, world, device = start()
    if args.epochs is not None:
        steps = epoch_steps(args.epochs, len(data.train), args.batch_size * args.grad_accum * world)
        warmup = cfg.warmup_steps if warmup_given else min(10, max(1, steps // 10))
        cfg = dataclasses.replace(cfg, steps=steps, warmup_steps=warmup)
    math_kept = math_settings(cfg, args, world, package)
    if args.resume:
        _say_resume(out, check_resume(out, math_kept, cfg.steps), cfg.steps)
    lora_config = package.lora
    if world == 1:
        model = build_model(spec, weight_map, release, lora_config, policy, device)
    else:
        model = build_parallel_model(spec, weight_map, release, lora_config, _plan(args, world, policy), rank, device)
    config = resolved_config(args, parser())
    sinks = open_sinks(out, args, config, last_checkpoint_step(out) if args.resume else None) if is_main() else []
    if is_main():
        # written only now, after every check: run.json never records settings that did not train
        write_run_json(out, pkg, release, train=dataclasses.asdict(cfg), seq_len=args.seq_len, data=str(args.data),
                       data_format=args.data_format, eval_data=args.eval_data, no_eval=args.no_eval,
                       epochs=args.epochs, memory=dataclasses.asdict(policy), math=math_kept)
        (out / "config.yaml").write_text(config_yaml(config))
    try:
        state = train(model, data, cfg, out, resume=args.resume, progress=not args.no_progress and is_main(),
                      sinks=sinks)
    except TrainingAborted as err:
        print(f"onboard: error: {err}", file=sys.stderr)
        return Exit.BUG
    finally:
        for sink in sinks:
            sink.close()
    factors = full_lora_state_dict(model)
    if is_main():
        # updated biases go beside the factors: export needs them to reproduce the run
        save_adapter(out, factors, lora_config, balance.bias_state_dict(model) if cfg.correction_bias_rate else None)
        evaluated = "no eval" if state["eval_loss"] is None else (
            f"eval loss {state['eval_loss']:.4f}, best {state['best_eval_loss']:.4f} at step {state['best_step']}")
        print(f"trained {state['step']} steps into {out}; {evaluated}")
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


def math_settings(cfg, args, world: int, package) -> dict:
    """The settings a resume must keep (onboard/commands/training/run_choice.py MATH_FLAGS says why each)."""
    import dataclasses

    train = dataclasses.asdict(cfg)
    kept = {key: train[key] for key in ("batch_size", "grad_accum", "lr", "warmup_steps", "weight_decay", "seed",
                                        "aux_loss_coef", "correction_bias_rate", "min_lr_ratio", "betas",
                                        "grad_clip", "loss_chunk")}
    return {**kept, "data_sha256": data_digest(Path(args.data)), "seq_len": args.seq_len, "world_size": world,
            "eval_fraction": args.eval_fraction, "capacity_factor": args.capacity_factor,
            "data_format": args.data_format, "no_eval": args.no_eval,
            "eval_data_sha256": data_digest(Path(args.eval_data)) if args.eval_data else None,
            "spec_hash": package.spec_hash, "lora": dataclasses.asdict(package.lora)}


def recorded_setting(out: Path, key: str):
    """A setting the run folder's run.json records (None when it records none)."""
    import json

    try:
        return json.loads((out / "run.json").read_text())["math"][key]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _say_resume(out: Path, step: int, steps: int) -> None:
    from runtime.parallel.process import is_main

    if not is_main():
        return
    if step == 0:
        print(f"onboard: {out} has no complete checkpoint yet: training it again from step 0", file=sys.stderr)
        return
    before = recorded_train_steps(out)
    stretched = (f" (it was to end at {before}: the learning-rate schedule from step {step} on follows {steps} steps)"
                 if before not in (None, steps) else "")
    print(f"onboard: resuming {out} from its checkpoint at step {step}, to step {steps}{stretched}", file=sys.stderr)


def recorded_train_steps(out: Path) -> int | None:
    import json

    try:
        return json.loads((out / "run.json").read_text())["train"]["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def open_sinks(out: Path, args, config: dict, resume_step: int | None) -> list:
    from runtime.train.sinks import TensorBoardSink, WandbSink

    sinks = [TensorBoardSink(out, resume_step)] if args.tensorboard else []
    if args.wandb:
        sinks.append(WandbSink(args.wandb, out, config))
    return sinks


def parser() -> argparse.ArgumentParser:
    """`onboard train`'s own parser (the trainer module torchrun runs, and --config's keys)."""
    parser = OnboardParser(prog="onboard train", formatter_class=DefaultsFormatter)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> Exit:
    """The trainer module torchrun runs on every rank: `torchrun --nproc-per-node N -m onboard.commands.train PKG ...`."""
    from onboard.commands.refusals import REFUSALS, refusal_exit

    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parser().parse_args(expand_config(["train", *argv], parser())[1:])
        check_flags(args)
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
