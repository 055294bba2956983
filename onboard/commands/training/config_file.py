"""`onboard train --config run.yaml`: every flag of `onboard train` as a key (`seq_len` or `seq-len`), flags on the
command line override the file; the resolved config (RUN/config.yaml, `--print-config`) reads back the same way.

The file's keys become flags placed before the command line's, so argparse itself applies the precedence (the last
occurrence wins) and every value passes the flag's own check; a key or value the flag would refuse is exit 2
naming the file and the key.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from onboard.errors import BadInput

# not keys of a config file: the package is named on the command line, and these say how to read the file itself
NOT_KEYS = {"help", "pkg", "config", "print_config"}
# kept out of the resolved config a run records: where and how this one invocation ran, not what the run is
# (re-running a saved config with the same --out would only be refused, RUN being taken)
NOT_RECORDED = NOT_KEYS | {"out", "resume"}


def expand_config(argv: list[str], train_parser: argparse.ArgumentParser) -> list[str]:
    """argv with `train --config FILE`'s keys inserted as flags right after `train` (any other argv unchanged)."""
    if not argv or argv[0] != "train":
        return argv
    path = _config_path(argv[1:])
    if path is None:
        return argv
    return [argv[0], *config_flags(Path(path), train_parser), *argv[1:]]


def _config_path(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def config_flags(path: Path, parser: argparse.ArgumentParser) -> list[str]:
    """The file's keys as command-line flags, each value checked by its flag's own type."""
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in NOT_KEYS}
    flags = []
    for key, value in _read(path).items():
        action = actions.get(str(key).replace("-", "_"))
        if action is None:
            raise BadInput(path, str(key), f"not a flag of `onboard train` (keys: {', '.join(sorted(actions))})")
        flags += _flag(path, str(key), action, value)
    return flags


def _read(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise BadInput(path, None, f"cannot read the config file ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise BadInput(path, None, f"not valid YAML ({getattr(err, 'problem', None) or err})") from None
    if not isinstance(data, (dict, type(None))):
        raise BadInput(path, None, f"expected a mapping of flag: value, got {type(data).__name__}")
    return data or {}


def _flag(path: Path, key: str, action: argparse.Action, value) -> list[str]:
    flag = action.option_strings[0]
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise BadInput(path, key, f"expected true or false, got {value!r}")
        return [flag] if value else []
    # null: the flag's default, as if the key were absent
    if value is None:
        return []
    if isinstance(value, (dict, list, bool)):
        raise BadInput(path, key, f"expected a single value, got {value!r}")
    text = str(value)
    try:
        if action.type is not None:
            action.type(text)
    except (argparse.ArgumentTypeError, ValueError, TypeError) as err:
        raise BadInput(path, key, str(err) or f"invalid value {text!r}") from None
    if action.choices is not None and text not in action.choices:
        raise BadInput(path, key, f"expected one of {', '.join(map(str, action.choices))}, got {text!r}")
    # one token, `--flag=value`: a value starting with "-" is not taken for a flag
    return [f"{flag}={text}"]


def resolved_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """Every flag's value after the file and the command line (the keys RUN/config.yaml records)."""
    return {a.dest: _plain(getattr(args, a.dest)) for a in parser._actions
            if a.option_strings and a.dest not in NOT_RECORDED}


def _plain(value):
    return str(value) if isinstance(value, Path) else value


def config_yaml(config: dict) -> str:
    return yaml.safe_dump(config, sort_keys=False)
