"""Progress of an alignment run, per check group (an op in tier 0, a layer in tier 1, a dtype in tier 2).

`Progress` writes plain lines (for logs and pipes, or nothing when given no writer); `RichProgress`
draws one bar per tier on a terminal. Tier functions call `plan(n)` to announce n more groups and
`group(name)` as each starts; the runner calls `start_tier`, `end_tier` and `note`.
"""
from __future__ import annotations

import sys
from typing import Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichBars, SpinnerColumn, TextColumn, TimeElapsedColumn


class Progress:
    def __init__(self, write: Callable[[str], None] | None = None):
        self._write = write
        self.tier, self.total, self.done = None, 0, 0

    def note(self, text: str) -> None:
        if self._write is not None:
            self._write(text)

    def start_tier(self, tier: int) -> None:
        self.tier, self.total, self.done = tier, 0, 0
        self.note(f"tier {tier}: running")

    def plan(self, num_groups: int) -> None:
        self.total += num_groups

    def group(self, name: str) -> None:
        self.done += 1
        self.note(f"tier {self.tier} [{self.done}/{self.total}]: {name}")

    def end_tier(self, text: str) -> None:
        self.note(text)


class RichProgress(Progress):
    """A bar per tier on the console (stderr in the CLI); the bar goes away when the tier ends, its summary stays."""

    def __init__(self, console: Console):
        super().__init__(lambda text: console.print(text, markup=False, highlight=False))
        self._bars = RichBars(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), console=console, transient=True)
        self._task = None

    def start_tier(self, tier: int) -> None:
        self.tier, self.total, self.done = tier, 0, 0
        self._bars.start()
        self._task = self._bars.add_task(f"tier {tier}", total=None)

    def plan(self, num_groups: int) -> None:
        super().plan(num_groups)
        self._bars.update(self._task, total=self.total)

    def group(self, name: str) -> None:
        self.done += 1
        self._bars.update(self._task, completed=self.done - 1, description=escape(f"tier {self.tier}: {name}"))
        # drawn now, not at the next timed refresh: a group that starts is shown even if it ends quickly
        self._bars.refresh()

    def end_tier(self, text: str) -> None:
        self._bars.update(self._task, completed=self.total)
        self._bars.stop()
        self._bars.remove_task(self._task)
        self.note(text)


def progress_on_stderr() -> Progress:
    """Rich bars when stderr is a terminal; plain lines when it is a pipe or a log file."""
    if sys.stderr.isatty():
        return RichProgress(Console(stderr=True))
    return Progress(lambda line: print(line, file=sys.stderr))
