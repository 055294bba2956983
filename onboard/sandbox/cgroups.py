"""Cgroups for one sandboxed run: a pids cap and a memory cap the kernel enforces on the whole tree (shared
mappings and tmpfs pages included, which rlimits miss), and the list of every process of the tree, so the
parent can kill them all at the end (a daemon that left the process group included).

Used where this process may create child cgroups (cgroup v1 `pids` and `memory` hierarchies, or cgroup v2
with those controllers delegated); elsewhere `Cgroups.create` gives an empty set and the sandbox relies
on rlimits (onboard/sandbox/run.py says which).
"""
from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("pids", "memory")
# each controller's cap file and the file counting its OOM kills, per cgroup version
CAP_FILES = {("pids", 1): "pids.max", ("memory", 1): "memory.limit_in_bytes",
             ("pids", 2): "pids.max", ("memory", 2): "memory.max"}
OOM_FILES = {1: ("memory.oom_control", "oom_kill"), 2: ("memory.events", "oom_kill")}


@dataclass
class Cgroups:
    dirs: dict[str, tuple[Path, int]] = field(default_factory=dict)  # controller -> (cgroup dir, version)

    @classmethod
    def create(cls, processes: int, memory_bytes: int) -> "Cgroups":
        """One fresh cgroup per controller this process may create, with its cap written; missing ones skipped."""
        groups = cls()
        caps = {"pids": processes, "memory": memory_bytes}
        for controller in CONTROLLERS:
            found = _own_cgroup(controller)
            if found is not None:
                made = _make(found[0] / f"onboard-sandbox-{uuid.uuid4().hex[:12]}", controller, found[1],
                             caps[controller])
                if made is not None:
                    groups.dirs[controller] = (made, found[1])
        return groups

    def has(self, controller: str) -> bool:
        return controller in self.dirs

    def join(self) -> None:
        """Move the calling process (the sandbox child, before it execs) into every cgroup."""
        for path, _ in self.dirs.values():
            (path / "cgroup.procs").write_text(str(os.getpid()))

    def oom_killed(self) -> bool:
        if "memory" not in self.dirs:
            return False
        path, version = self.dirs["memory"]
        name, key = OOM_FILES[version]
        try:
            fields = dict(line.split() for line in (path / name).read_text().splitlines() if len(line.split()) == 2)
        except OSError:
            return False
        return int(fields.get(key, 0)) > 0

    def kill_all(self) -> None:
        """SIGKILL every process still in the cgroups until none is left (the pids cap bounds the loop)."""
        for _ in range(200):
            pids = self._pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        for path, _ in self.dirs.values():
            for _ in range(100):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    # a killed process is leaving the cgroup: it is empty in a moment
                    time.sleep(0.02)

    def _pids(self) -> set[int]:
        pids = set()
        for path, _ in self.dirs.values():
            try:
                pids.update(int(p) for p in (path / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return pids


def _own_cgroup(controller: str) -> tuple[Path, int] | None:
    """This process's cgroup directory holding `controller`, and the cgroup version."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        number, names, path = line.split(":", 2)
        if controller in names.split(","):
            mount = ROOT / names.removeprefix("name=")
            return (mount / path.lstrip("/"), 1) if mount.is_dir() else None
    for line in lines:
        number, names, path = line.split(":", 2)
        if number == "0" and names == "" and (ROOT / "cgroup.controllers").exists():
            return ROOT / path.lstrip("/"), 2
    return None


def _make(path: Path, controller: str, version: int, cap: int) -> Path | None:
    """The cgroup with its cap written, or None where it cannot be made or capped here."""
    try:
        path.mkdir()
    except OSError:
        return None
    try:
        (path / CAP_FILES[controller, version]).write_text(str(cap))
        # swap would let the tree hold more than the cap: none beyond it (where the kernel accounts swap)
        swap = {1: ("memory.memsw.limit_in_bytes", str(cap)), 2: ("memory.swap.max", "0")}[version]
        if controller == "memory" and (path / swap[0]).exists():
            (path / swap[0]).write_text(swap[1])
        return path
    except OSError:
        path.rmdir()
        return None
