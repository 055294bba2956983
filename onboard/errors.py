"""The error model: bad input is one BadInput (exit 2, one line); anything else is a bug (exit 1).

A bug never shows the user a traceback: `report_internal_error` writes the full trace to a file
and returns one line naming the exception, where it was raised and where the trace went.
"""
from __future__ import annotations

import tempfile
import traceback
from pathlib import Path


class BadInput(Exception):
    """A file malformed in itself: names the file, the key or tensor, and what was expected."""

    def __init__(self, path: str | Path | None, key: str | None, message: str):
        self.path = str(path) if path is not None else None
        self.key = key
        self.message = message
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = self.path or "<input>"
        if self.key:
            where = f"{where}: {self.key}"
        return printable(f"{where}: {self.message}")



def printable(text: str) -> str:
    """text on one line: control characters and lone surrogates escaped, the rest unchanged."""
    if text.isprintable() and text.isascii():
        return text
    return "".join(ch if ch.isprintable() and _encodable(ch) else ascii(ch)[1:-1] for ch in text)


def _encodable(ch: str) -> bool:
    return not 0xD800 <= ord(ch) <= 0xDFFF


def report_internal_error(exc: BaseException) -> str:
    """Write the full trace to a temp file; return the one line that names the bug and that file."""
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    with tempfile.NamedTemporaryFile("w", prefix="onboard-trace-", suffix=".txt", delete=False,
                                     encoding="utf-8", errors="backslashreplace") as f:
        f.write(trace)
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    message = printable(str(exc))[:200]
    return f"internal error (a bug in onboard, please report it): {type(exc).__name__}: {message}{where}; full trace in {f.name}"
