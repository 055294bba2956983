"""`onboard train --nproc N`: the same command re-run under torchrun (torch.distributed.run), N ranks per node.

The ranks run `python -m onboard.commands.train` with the user's arguments (minus the launch options); torchrun
ends every rank when one fails, prints that rank's error and returns nonzero, and since rank 0 commits a
checkpoint only after every rank wrote its shards, a failed job commits none. Several nodes: the same
command on each with --nnodes and --rdzv-endpoint (torchrun's c10d rendezvous).
"""
from __future__ import annotations

import argparse
import subprocess
import sys

TRAINER_MODULE = "onboard.commands.train"
# left out of each rank's command line; --config too: the namespace already holds the file's values resolved
# against the command line, and re-reading the file on a rank would let it override a flag set to its default
LAUNCH_OPTIONS = ("nproc", "nnodes", "rdzv_endpoint", "config")


def torchrun_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}"]
    if args.nnodes > 1:
        command += [f"--nnodes={args.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}"]
    else:
        command.append("--standalone")
    return command + ["-m", TRAINER_MODULE, *_argv(parser, args)]


def _argv(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The command line that parses back into `args` (launch options left out)."""
    argv = []
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.dest in LAUNCH_OPTIONS or action.dest == "help" or value == action.default:
            continue
        if not action.option_strings:
            argv.append(str(value))
        elif isinstance(action, argparse._StoreTrueAction):
            argv.append(action.option_strings[0])
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def launch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the job under torchrun; its exit status (nonzero when any rank failed)."""
    return subprocess.run(torchrun_command(parser, args)).returncode
