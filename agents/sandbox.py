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
from typing import Literal, Sequence

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


# `python -I -c PROJECT_BOOT REPO MODULE ARGS...`: this project's code first on the path (isolated mode ignores
# PYTHONPATH, and the environment is scrubbed), then MODULE run as __main__ with ARGS.
PROJECT_BOOT = ("import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
                "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")


def run_project_module(module: str, args: Sequence[str], workdir: Path, readable: Sequence[Path] = (),
                       limits: Limits = Limits(), env: dict[str, str] | None = None) -> SandboxResult:
    """`python -m module args` of this project's code under bubblewrap (the caller checks available_mode() is
    "bwrap"), for code that needs the project and its libraries, transformers included, but must not reach
    anything else: the file system holds the system folders, the interpreter and its import roots, this project
    without its .git, the `readable` paths (read-only, any .git in them hidden) and workdir, the one writable
    place; no home, no other checkout, no network, no host IPC, a fresh /tmp; the environment is the sandbox's
    allow-list plus `env`."""
    workdir = Path(workdir).resolve()
    inner = [sys.executable, "-I", "-c", PROJECT_BOOT, str(REPO), module, *map(str, args)]
    return _run(_project_bwrap_argv(inner, workdir, readable), workdir, limits, "bwrap", extra_env=env)


def _project_bwrap_argv(inner: list[str], workdir: Path, readable: Sequence[Path]) -> list[str]:
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for top in map(Path("/").joinpath, SYSTEM_DIRS):
        if top.is_symlink():
            argv += ["--symlink", os.readlink(top), str(top)]
        elif top.is_dir():
            argv += ["--ro-bind", str(top), str(top)]
    for root in (*_interpreter_roots(), REPO, *(Path(p).resolve() for p in readable)):
        argv += ["--ro-bind", str(root), str(root), *_hide_git(root)]
    # a CUDA device stays usable: its nodes, and the driver's view of the hardware
    for node in sorted(Path("/dev").glob("nvidia*")):
        argv += ["--dev-bind", str(node), str(node)]
    if any(Path("/dev").glob("nvidia*")):
        argv += ["--ro-bind", "/sys", "/sys"]
    return argv + ["--bind", str(workdir), str(workdir), "--chdir", str(workdir), "--", *inner]


def _hide_git(root: Path) -> list[str]:
    """A checkout's .git (its history, and the credentials a CI checkout keeps in .git/config) hidden: a folder
    behind an empty tmpfs, a worktree's .git file behind /dev/null."""
    git = root / ".git"
    if git.is_dir() and not git.is_symlink():
        return ["--tmpfs", str(git)]
    return ["--ro-bind", "/dev/null", str(git)] if git.exists() or git.is_symlink() else []


@functools.lru_cache(maxsize=1)
def _interpreter_roots() -> tuple[Path, ...]:
    """The child interpreter's prefixes and import roots (isolated mode, as it will run) outside the system
    folders, without source checkouts on the path (an editable install of another project stays unseen)."""
    probe = "import sys\nfor p in [sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path]: print(p)"
    found = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, timeout=60)
    paths = {Path(line).resolve() for line in found.stdout.splitlines() if line.strip().startswith("/")}
    system = tuple(Path("/", top).resolve() for top in SYSTEM_DIRS)
    keep = [p for p in paths if p.exists() and not (p / ".git").exists()
            and not any(p.is_relative_to(s) for s in system)]
    # a path inside another one is bound with it
    return tuple(sorted(p for p in keep if not any(p != q and p.is_relative_to(q) for q in keep)))


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


def _run(argv: list[str], workdir: Path, limits: Limits, mode: Mode,
         extra_env: dict[str, str] | None = None) -> SandboxResult:
    out_path, err_path = workdir / ".stdout", workdir / ".stderr"
    start = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        process = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=workdir,
                                   env={**_environment(workdir), **(extra_env or {})}, preexec_fn=_limit(limits),
                                   start_new_session=True)
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
