"""The runtime's exception for malformed input files (package, run folder, data); `onboard` turns it
into exit code 2 and one line, as it does its own BadInput. And the one for a generated op that disagrees
with its reference where it runs (exit 3: valid input we do not trust)."""
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


class GeneratedOpMismatch(ValueError):
    """A package's generated op disagreed with its reference on the real inputs of its first call."""
