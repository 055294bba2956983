"""Run untrusted generated code in a separate process the operating system confines.

Mode `bwrap` (bubblewrap): a read-only view of the root, one writable folder (the work dir), a private /tmp, a new
network namespace (loopback only) and PID namespace (killing it kills the whole tree), the reference code and
transformers hidden behind empty tmpfs mounts so a candidate cannot copy its answer. Mode `unshare` (no bwrap): a
network namespace from `unshare -n` and the audit-hook guard below as a tripwire for writes and sockets. Both add
rlimits (RLIMIT_DATA caps host memory without breaking CUDA, as RLIMIT_AS does), a wall-clock timeout that kills the
process group, and output to files capped by RLIMIT_FSIZE. The result says which mode ran; the parent survives
whatever the child does.
"""
from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agents.sandbox_guard import HIDDEN_PACKAGES

Mode = Literal["bwrap", "unshare", "none"]
GUARD = Path(__file__).with_name("sandbox_guard.py")
REPO = Path(__file__).resolve().parents[1]
OUTPUT_TAIL = 20_000


@dataclass(frozen=True)
class Limits:
    wall_s: float = 120.0
    memory_mib: int = 4096
    cpu_s: int = 300
    file_mib: int = 256
    open_files: int = 512


@dataclass(frozen=True)
class SandboxResult:
    mode: Mode
    returncode: int | None
    timed_out: bool
    wall_s: float
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def available_mode() -> Mode:
    """The strongest confinement this machine offers: bwrap that actually starts, else unshare -n, else none."""
    if shutil.which("bwrap") and _runs(["bwrap", "--ro-bind", "/", "/", "--unshare-net", "true"]):
        return "bwrap"
    if shutil.which("unshare") and _runs(["unshare", "-n", "true"]):
        return "unshare"
    return "none"


def _runs(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_python(script: Path, workdir: Path, args: list[str] = (), limits: Limits = Limits(),
               mode: Mode | None = None) -> SandboxResult:
    """Run `python script args` confined to workdir (which must exist and holds everything it writes)."""
    workdir = Path(workdir).resolve()
    mode = mode or available_mode()
    # the guard runs from the work dir: its own folder (agents/) is hidden from the child
    guard = shutil.copy(GUARD, workdir / GUARD.name)
    inner = [sys.executable, "-I", str(guard), str(workdir), str(script), *map(str, args)]
    argv = {"bwrap": _bwrap_argv, "unshare": _unshare_argv, "none": lambda inner, w: inner}[mode](inner, workdir)
    return _run(argv, workdir, limits, mode)


def _bwrap_argv(inner: list[str], workdir: Path) -> list[str]:
    argv = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
            "--bind", str(workdir), str(workdir), "--unshare-net", "--unshare-pid", "--die-with-parent",
            "--new-session", "--chdir", str(workdir)]
    # the private /tmp would hide an interpreter or a checkout that lives there (a clone in /tmp): bound back read-only
    for root in _roots_under_tmp():
        argv += ["--ro-bind", str(root), str(root)]
    for hidden in _hidden_paths():
        argv += ["--tmpfs", str(hidden)]
    return argv + ["--", *inner]


@functools.lru_cache(maxsize=1)
def _hidden_paths() -> tuple[Path, ...]:
    """Where the child's interpreter (isolated mode, as it will run) finds the hidden packages."""
    probe = ("import importlib.util, sys\n"
             f"for name in {HIDDEN_PACKAGES!r}:\n"
             "    spec = importlib.util.find_spec(name)\n"
             "    for p in (spec.submodule_search_locations or []) if spec else []: print(p)")
    found = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, timeout=60)
    return tuple(Path(line) for line in found.stdout.splitlines() if line.strip())


@functools.lru_cache(maxsize=1)
def _roots_under_tmp() -> tuple[Path, ...]:
    """The child's interpreter prefixes and import roots (isolated mode, as it will run) that lie under /tmp."""
    probe = "import sys\nfor p in [sys.prefix, sys.base_prefix, *sys.path]: print(p)"
    found = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, timeout=60)
    paths = {Path(line).resolve() for line in found.stdout.splitlines() if line.strip()}
    under = [p for p in paths if p.is_relative_to("/tmp") and p.exists()]
    # a path inside another one is bound with it
    return tuple(sorted(p for p in under if not any(p != q and p.is_relative_to(q) for q in under)))


def _unshare_argv(inner: list[str], workdir: Path) -> list[str]:
    return ["unshare", "-n", "--", *inner]


def _environment(workdir: Path) -> dict[str, str]:
    """A small allow-list: no keys or endpoints of the parent leak into the child."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "OMP_NUM_THREADS": "1",
           "TRITON_CACHE_DIR": str(workdir / ".triton"), "TORCHINDUCTOR_CACHE_DIR": str(workdir / ".inductor"),
           "PYTHONDONTWRITEBYTECODE": "1"}
    if "TRITON_INTERPRET" in os.environ:
        env["TRITON_INTERPRET"] = os.environ["TRITON_INTERPRET"]
    return env


def _limit(limits: Limits):
    def apply() -> None:
        mib = 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (limits.memory_mib * mib, limits.memory_mib * mib))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mib * mib, limits.file_mib * mib))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _run(argv: list[str], workdir: Path, limits: Limits, mode: Mode) -> SandboxResult:
    out_path, err_path = workdir / ".stdout", workdir / ".stderr"
    start = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        process = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=workdir,
                                   env=_environment(workdir), preexec_fn=_limit(limits), start_new_session=True)
        timed_out = False
        try:
            process.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        # the whole process group: a child the candidate started must not outlive it
        _kill_group(process.pid)
        process.wait()
    return SandboxResult(mode, None if timed_out else process.returncode, timed_out, time.monotonic() - start,
                         _tail(out_path), _tail(err_path))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - OUTPUT_TAIL))
        return f.read().decode("utf-8", "replace")
