"""The `onboard` command's exit codes, one enum every command returns from (never a bare number)."""
from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    # a bug (one line, the trace in a file), or a training run that aborted (non-finite steps, a failed rank)
    BUG = 1
    # a file malformed in itself: one line naming the file and the key
    BAD_INPUT = 2
    # valid input we do not support or trust yet (gaps remain, alignment or a check failed): one honest line
    GAPS = 3
    # Ctrl-C: the shell's convention, 128 + SIGINT
    INTERRUPTED = 130
