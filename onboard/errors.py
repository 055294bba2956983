"""The one exception type for bad input; the CLI turns it into exit code 2 and one line."""
from __future__ import annotations

from pathlib import Path


class OnboardError(Exception):
    """Bad input: names the file, the key or tensor, and what was expected."""

    def __init__(self, path: str | Path | None, key: str | None, message: str):
        self.path = str(path) if path is not None else None
        self.key = key
        self.message = message
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = self.path or "<input>"
        if self.key:
            where = f"{where}: {self.key}"
        return f"{where}: {self.message}".replace("\n", " ")
