"""The trainer's progress on stderr: a rich bar on a terminal; plain lines when stderr is a file or a pipe (a batch
job's log), where a bar would show only its final state.

Plain lines come at the first and last step, every total/PLAIN_LINES steps, and at least every PLAIN_SECONDS, so
a log file shows a long run moving and a short one in a handful of lines.
"""
from __future__ import annotations

import sys
import time

PLAIN_LINES = 20
PLAIN_SECONDS = 60.0


class TrainProgress:
    def __init__(self, enabled: bool, total: int, start: int, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled, self.total, self.start = enabled, total, start
        self.every = max(1, total // PLAIN_LINES)
        self.bar = _rich_bar(self.stream) if enabled and self.stream.isatty() else None

    def __enter__(self):
        self.started = self.last_line = time.monotonic()
        if self.bar is not None:
            self.bar.__enter__()
            self.task = self.bar.add_task("train", total=self.total, completed=self.start, stats="")
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, step: int, stats: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, stats=stats)
        elif self.enabled and self._line_due(step):
            self.last_line = time.monotonic()
            print(f"train step {step}/{self.total}  {stats}  elapsed {self.last_line - self.started:.0f}s",
                  file=self.stream, flush=True)

    def _line_due(self, step: int) -> bool:
        return (step in (self.start + 1, self.total) or step % self.every == 0
                or time.monotonic() - self.last_line >= PLAIN_SECONDS)

    def note(self, text: str) -> None:
        """A line shown whether progress is on or not (a skipped step)."""
        if self.bar is not None:
            self.bar.console.print(text)
        else:
            print(text, file=self.stream, flush=True)


def _rich_bar(stream):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    TextColumn("{task.fields[stats]}"), console=Console(file=stream))
