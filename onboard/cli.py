"""The `onboard` command. Exit codes: 0 ok, 1 a bug (one line, trace in a file), 2 bad input (one line), 3 gaps remain."""
from __future__ import annotations

import argparse
import functools
import io
import os
import sys

from onboard.commands import align, approve, bench, data, demo, example_model, export, inspect, new_model, plan, train
from onboard.commands.args import DefaultsFormatter, OnboardParser
from onboard.commands.refusals import REFUSALS, refusal_exit
from onboard.commands.training.config_file import expand_config
from onboard.errors import report_internal_error
from onboard.exit_codes import Exit
from onboard.release.config_view import NotRecognized
from runtime.spec import SpecError

# (command, its module, its help line), in the order `onboard --help` lists them
COMMANDS = [
    ("inspect", inspect, "gap report of a released model folder (writes nothing)"),
    ("example-model", example_model, "write a tiny random-weight release of a real family"),
    ("new-model", new_model, "onboard a release: the package, generated ops for its gaps, alignment"),
    ("plan", plan, "search dp_shard x ep meshes, activation policies and micro-batches for a cluster"),
    ("align", align, "run the alignment tiers against the model's own implementation"),
    ("approve", approve, "approve the package's op files (PKG/ops/) after review: align and train run them in "
                         "this process only then"),
    ("data", data, "samples of a data file as training sees them: the template's rendering, trained tokens marked"),
    ("train", train, "train the package's LoRA on your data (run folder: checkpoints, metrics, plots)"),
    ("export", export, "a run's adapter in PEFT's format, or the release with it merged"),
    ("bench", bench, "tokens/s, MFU, step latency, peak memory and per-op time of the package's LoRA step"),
    ("demo", demo, "the whole loop on a tiny hybrid MoE on CPU: release, package, training, PEFT adapter"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = OnboardParser(prog="onboard", description=__doc__)
    parser.add_argument("--version", action="version", version=f"onboard {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module, help_line in COMMANDS:
        p = sub.add_parser(name, help=help_line, description=help_line, formatter_class=DefaultsFormatter)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    # the demo runs each stage through this command's own main, handed down so the demo sits below the CLI
    sub.choices["demo"].set_defaults(run=functools.partial(demo.run, cli_main=main))
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("onboard")
    except PackageNotFoundError:
        return "(not installed: run from a source tree)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # a name that slipped past the checks must not turn printing into a crash
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        # `train --config FILE`: the file's keys become flags placed before the command line's, which override them
        args = build_parser().parse_args(expand_config(argv, train.parser()))
        return args.run(args)
    except REFUSALS as err:
        return refusal_exit(err)
    except NotRecognized as gap:
        # a valid release whose basic widths are not recognized: nothing to report per component
        print(f"onboard: gap: config.json: {gap}: not recognized", file=sys.stderr)
        return Exit.GAPS
    # a package's spec.json the runtime cannot read (the message names the key path)
    except SpecError as err:
        print(f"onboard: error: {err}", file=sys.stderr)
        return Exit.BAD_INPUT
    except KeyboardInterrupt:
        print("onboard: interrupted", file=sys.stderr)
        return Exit.INTERRUPTED
    except BrokenPipeError:
        # the reader (`| head`) went away; point stdout at devnull so the exit-time flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return Exit.OK
    # the one place a bug is caught: the user gets one line, the trace goes to a file
    except Exception as exc:  # noqa: BLE001
        print(f"onboard: {report_internal_error(exc)}", file=sys.stderr)
        return Exit.BUG


if __name__ == "__main__":
    sys.exit(main())


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
