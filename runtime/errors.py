"""The runtime's exceptions: malformed input files (package, run folder, data), which `onboard` turns into exit
code 2 and one line, as it does its own BadInput; package code it will not run, and a generated op that disagrees
with its reference where it runs (both exit 3: valid input we do not trust)."""
from __future__ import annotations

from pathlib import Path


class InputFileError(ValueError):
    """Names the file, the key (or line), and what was expected."""

    def __init__(self, path: str | Path, key: str | None, message: str):
        self.path, self.key, self.message = str(path), key, message
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = f"{self.path}: {self.key}" if self.key else self.path
        return f"{where}: {self.message}".replace("\n", " ")


class PackageOpRefused(Exception):
    """A file under PKG/ops/ that will not run here: unapproved, not a Python op, or an op the runtime does not
    take (exit 3, one line naming the file)."""

    def __init__(self, path: str | Path, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(self.one_line())

    def one_line(self) -> str:
        return f"{self.path} {self.reason}".replace("\n", " ")


class GeneratedOpMismatch(ValueError):
    """A package's generated op disagreed with its reference on the real inputs of its first call."""


class StoredUnsupported(ValueError):
    """Weights a release stores quantized that the runtime cannot hold so yet (a stored weight outside linear layers
    and routed experts, a row split inside a scale block, transformers' own modules over stored weights): valid
    input not supported, exit 3 with the reason."""
