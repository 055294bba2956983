"""The refusals a command entry point (the CLI, and the trainer module torchrun runs on every rank) turns into
one stderr line and an exit code, never a traceback."""
from __future__ import annotations

import sys

from onboard.errors import BadInput, printable
from onboard.exit_codes import Exit
from runtime.errors import GeneratedOpMismatch, InputFileError, PackageOpRefused, StoredUnsupported

REFUSALS = (BadInput, InputFileError, PackageOpRefused, GeneratedOpMismatch, StoredUnsupported)


def refusal_exit(err: Exception) -> Exit:
    """Bad input files exit 2; package code that will not run here, and a generated op that train's spot check
    caught disagreeing with its reference, exit 3 (valid input we do not trust)."""
    if isinstance(err, PackageOpRefused):
        print(f"onboard: refused: {printable(err.one_line())}", file=sys.stderr)
        return Exit.GAPS
    if isinstance(err, StoredUnsupported):
        print(f"onboard: gap: {printable(str(err))}", file=sys.stderr)
        return Exit.GAPS
    if isinstance(err, GeneratedOpMismatch):
        print(f"onboard: error: {err}", file=sys.stderr)
        return Exit.GAPS
    print(f"onboard: error: {err.one_line()}", file=sys.stderr)
    return Exit.BAD_INPUT
