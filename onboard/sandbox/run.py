"""Run untrusted generated code in a separate process the operating system confines.

Mode `bwrap` (bubblewrap): the child sees an empty root with only the system libraries, its interpreter and
its import roots read-only, one writable folder (the work dir), a private bounded /tmp and /dev/shm, a fresh
/proc of its own PID namespace (no other process visible), no network (loopback only). The checkout, its git
objects, the user's home, the reference code and transformers are not there. Mode `unshare` (no bwrap): a
network namespace from `unshare -n` and the audit-hook guard (onboard/sandbox/guard.py) as a tripwire for
writes and sockets; it hides no path.

Limits, in every mode: a pids and a memory cgroup where this process may create them (onboard/sandbox/cgroups.py:
the memory cap then covers shared mappings and tmpfs pages too), else RLIMIT_NPROC and RLIMIT_AS; RLIMIT_DATA
(a MemoryError for plain allocations), CPU time, file size, open files; a wall-clock limit. When the run ends the
whole tree is killed: the process group, the PID namespace (bwrap's init dies with its parent) and every process
left in the cgroups (a daemon that left the group). The result says which mode ran; the parent survives whatever
the child does.
"""
from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal, Sequence

import reference_ops
from onboard.sandbox import guard as sandbox_guard
from onboard.sandbox.cgroups import Cgroups
from onboard.sandbox.guard import HIDDEN_PACKAGES

Mode = Literal["bwrap", "unshare", "none"]
# the guard script found through its module, so both can move
GUARD = Path(sandbox_guard.__file__)
# the checkout, found through its lowest package (empty, so importing it costs nothing) wherever this module lives
REPO = Path(reference_ops.__file__).resolve().parents[1]
OUTPUT_TAIL = 20_000
MIB = 2**20
# what a dynamically linked interpreter needs from the root, bound read-only where it exists
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives")
NAMESPACES = ("--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
              "--die-with-parent", "--new-session")


@dataclass(frozen=True)
class Limits:
    wall_s: float = 120.0
    memory_mib: int = 4096
    cpu_s: int = 300
    file_mib: int = 256
    open_files: int = 512
    # processes and threads of the whole tree (torch starts a few threads of its own)
    processes: int = 64
    # the private /dev/shm and /tmp (bwrap mode); their pages also count against memory_mib under a cgroup
    shm_mib: int = 64
    tmp_mib: int = 256


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
               mode: Mode | None = None, *, tripwire: bool = True) -> SandboxResult:
    """Run `python script args` confined to workdir (which must exist and holds everything it writes).
    `tripwire=False` leaves out the audit-hook guard: what confines the child is then the OS alone."""
    with start_python(script, workdir, args, limits, mode, talk=False, tripwire=tripwire) as child:
        child.wait()
    return child.result


def start_python(script: Path, workdir: Path, args: list[str] = (), limits: Limits = Limits(),
                 mode: Mode | None = None, talk: bool = True, *, tripwire: bool = True) -> "Child":
    """Start `python script args` confined to workdir; with `talk`, its stdin and stdout are pipes to the
    caller (`child.stdin`, `child.stdout`). Use as a context manager: leaving it kills the whole tree."""
    workdir = Path(workdir).resolve()
    mode = mode or available_mode()
    # the guard runs from the work dir: its own folder (agents/) is hidden from the child
    guard = shutil.copy(GUARD, workdir / GUARD.name)
    inner = [sys.executable, "-I", str(guard), *([] if tripwire else ["--no-guard"]), str(workdir), str(script),
             *map(str, args)]
    argv = {"bwrap": _bwrap_argv, "unshare": _unshare_argv, "none": lambda inner, w, lim: inner}[mode](
        inner, workdir, limits)
    return Child(argv, workdir, limits, mode, talk)


class Child:
    """A confined process tree: its limits, its deadline and its end (everything in it killed)."""

    def __init__(self, argv: list[str], workdir: Path, limits: Limits, mode: Mode, talk: bool,
                 env: dict[str, str] | None = None):
        self.workdir, self.limits, self.mode, self.talk = workdir, limits, mode, talk
        self.cgroups = Cgroups.create(limits.processes, limits.memory_mib * MIB)
        self.timed_out, self.result = False, None
        self._err = open(workdir / ".stderr", "wb")
        self._out = None if talk else open(workdir / ".stdout", "wb")
        self.start = time.monotonic()
        try:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.PIPE if talk else subprocess.DEVNULL,
                stdout=subprocess.PIPE if talk else self._out, stderr=self._err, cwd=workdir,
                env={**_environment(workdir), **(env or {})}, preexec_fn=_confine(limits, self.cgroups), start_new_session=True)
        except BaseException:
            self.cgroups.remove()
            for f in (self._err, self._out):
                if f is not None:
                    f.close()
            raise
        # the deadline holds even while the caller is blocked reading a pipe: the tree is killed under it
        self._timer = threading.Timer(limits.wall_s, self._expire)
        self._timer.start()

    @property
    def stdin(self) -> IO[bytes]:
        return self.process.stdin

    @property
    def stdout(self) -> IO[bytes]:
        return self.process.stdout

    def wait(self) -> None:
        self.process.wait()

    def _expire(self) -> None:
        # a child that ended just before the deadline is not a timeout (stop() cancels the timer a moment later)
        if self.process.poll() is None:
            self.timed_out = True
        self._kill()

    def _kill(self) -> None:
        # the whole process group, then whatever left it but stayed in the cgroups
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.cgroups.kill_all()

    def stop(self) -> SandboxResult:
        """Kill what is left of the tree, remove its cgroups and report."""
        if self.result is not None:
            return self.result
        if self.process.stdin is not None:
            # end of input: a child waiting for the next request leaves by itself (briefly waited for)
            _close(self.process.stdin)
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        self._timer.cancel()
        returncode = self.process.poll()
        self._kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                _close(pipe)
        oom = self.cgroups.oom_killed()
        self.cgroups.remove()
        for f in (self._err, self._out):
            if f is not None:
                f.close()
        stderr = _tail(self.workdir / ".stderr")
        if oom:
            stderr += f"\nsandbox: killed at the memory limit ({self.limits.memory_mib} MiB, out of memory)\n"
        self.result = SandboxResult(self.mode, None if self.timed_out else returncode, self.timed_out,
                                    time.monotonic() - self.start, "" if self.talk else _tail(self.workdir / ".stdout"),
                                    stderr)
        return self.result

    def __enter__(self) -> "Child":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _close(pipe: IO[bytes]) -> None:
    try:
        pipe.close()
    except OSError:
        pass  # unsent bytes to a child that is gone (BrokenPipeError): nothing to deliver them to


def _bwrap_argv(inner: list[str], workdir: Path, limits: Limits, readable: tuple[Path, ...] = (),
                hidden: tuple[Path, ...] | None = None, devices: Sequence[str] = ()) -> list[str]:
    """`readable`: more paths the child may read (bound read-only, after the interpreter's); `hidden`: the
    package folders covered by an empty tmpfs where they lie under a bound path (default: HIDDEN_PACKAGES');
    `devices`: more bwrap arguments binding device nodes."""
    roots = _interpreter_roots() + tuple(Path(p) for p in readable)
    argv = ["bwrap", *NAMESPACES, *_system_mounts(), *_private_mounts(limits), *_read_only(roots),
            *_hidden_mounts(roots, _hidden_paths() if hidden is None else hidden), *devices,
            "--bind", str(workdir), str(workdir), *_read_only_after_binds(), "--chdir", str(workdir)]
    return argv + ["--", *inner]


# `python -I -c PROJECT_BOOT REPO MODULE ARGS...`: this project's code first on the path (isolated mode ignores
# PYTHONPATH, and the environment is scrubbed), then MODULE run as __main__ with ARGS.
PROJECT_BOOT = ("import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
                "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def run_project_module(module: str, args: Sequence[str], workdir: Path, readable: Sequence[Path] = (),
                       limits: Limits = Limits(), env: dict[str, str] | None = None) -> SandboxResult:
    """`python -m module args` of this project's code under bubblewrap (the caller checks available_mode() is
    "bwrap"), for code that needs the project and its libraries, transformers included, but must not reach
    anything else: the system folders, the interpreter and its import roots, this project without its git
    folders, the `readable` paths (read-only) and workdir, the one writable place; no home, no network, no host
    IPC, private /tmp and /dev/shm; the environment is the sandbox's allow-list plus `env`."""
    workdir = Path(workdir).resolve()
    inner = [sys.executable, "-I", "-c", PROJECT_BOOT, str(REPO), module, *map(str, args)]
    roots = (REPO, *(Path(p).resolve() for p in readable))
    argv = _bwrap_argv(inner, workdir, limits, readable=roots, hidden=(), devices=_gpu_devices())
    with Child(argv, workdir, limits, "bwrap", talk=False, env=env) as child:
        child.wait()
    return child.result


def _gpu_devices() -> list[str]:
    """A CUDA device stays usable: its nodes, and the driver's view of the hardware."""
    nodes = sorted(Path("/dev").glob("nvidia*"))
    argv = [arg for node in nodes for arg in ("--dev-bind", str(node), str(node))]
    return argv + (["--ro-bind", "/sys", "/sys"] if nodes else [])


def _system_mounts() -> list[str]:
    argv = []
    for path in map(Path, SYSTEM_DIRS + SYSTEM_FILES):
        if path.is_symlink() and path.parent == Path("/"):
            # /lib -> usr/lib on merged-/usr systems: the same link inside
            argv += ["--symlink", os.readlink(path), str(path)]
        elif path.exists():
            argv += ["--ro-bind", str(path), str(path)]
    return argv


def _private_mounts(limits: Limits) -> list[str]:
    # a fresh /dev (null, zero, random, tty...) whose /dev/shm is a tmpfs of bounded size, a bounded /tmp, and
    # a /proc of the child's own PID namespace: other processes' /proc entries do not exist inside
    if _tmpfs_size_supported():
        return ["--dev", "/dev", "--size", str(limits.shm_mib * MIB), "--tmpfs", "/dev/shm",
                "--size", str(limits.tmp_mib * MIB), "--tmpfs", "/tmp", "--proc", "/proc"]
    # a bubblewrap older than --size (0.6 and before) cannot bound a tmpfs: both made read-only instead (after
    # the work dir is bound under /tmp), so nothing is written outside the work dir
    return ["--dev", "/dev", "--tmpfs", "/dev/shm", "--tmpfs", "/tmp", "--proc", "/proc"]


def _read_only_after_binds() -> list[str]:
    return [] if _tmpfs_size_supported() else ["--remount-ro", "/dev/shm", "--remount-ro", "/tmp"]


@functools.lru_cache(maxsize=1)
def _tmpfs_size_supported() -> bool:
    return _runs(["bwrap", "--ro-bind", "/", "/", "--size", str(MIB), "--tmpfs", "/tmp", "true"])


def _read_only(roots: tuple[Path, ...]) -> list[str]:
    argv = []
    for root in roots:
        argv += ["--ro-bind", str(root), str(root)]
    return argv


def _hidden_mounts(roots: tuple[Path, ...], packages: tuple[Path, ...]) -> list[str]:
    """Empty tmpfs over what must stay unseen although it lies under a bound root: the checkout, its git
    folders and the home (a root inside one of them is bound again on top), then the hidden packages."""
    argv = []
    for secret in _secret_paths():
        if any(secret != root and secret.is_relative_to(root) for root in roots):
            argv += ["--tmpfs", str(secret)]
            argv += _read_only(tuple(root for root in roots if root != secret and root.is_relative_to(secret)))
    for hidden in packages:
        if any(hidden.is_relative_to(root) for root in roots):
            argv += ["--tmpfs", str(hidden)]
    return argv


@functools.lru_cache(maxsize=1)
def _secret_paths() -> tuple[Path, ...]:
    """The project's checkout, its git folders (a worktree's and the common one) and the user's home."""
    return tuple(dict.fromkeys(p.resolve() for p in (REPO, *_git_dirs(REPO), Path.home()) if p.exists()))


def _git_dirs(repo: Path) -> list[Path]:
    dot_git = repo / ".git"
    if not dot_git.is_file():
        return [dot_git]
    # a worktree: `.git` names its own git folder, whose `commondir` names the repository's objects
    own = (repo / dot_git.read_text().removeprefix("gitdir:").strip()).resolve()
    common = own / "commondir"
    return [own] + ([(own / common.read_text().strip()).resolve()] if common.is_file() else [])


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
def _interpreter_roots() -> tuple[Path, ...]:
    """The child's interpreter prefixes and import roots (isolated mode, as it will run), less any checkout
    (an editable install's source root): the folders the child reads its interpreter and libraries from."""
    probe = "import sys\nfor p in [sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path]: print(p)"
    found = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, timeout=60)
    paths = {Path(line).resolve() for line in found.stdout.splitlines() if line.strip().startswith("/")}
    paths.add(Path(sys.executable).resolve().parent)
    roots = [p for p in paths if p.is_dir() and not _is_checkout(p) and p != Path("/")]
    # a path inside another one is bound with it
    return tuple(sorted(p for p in roots if not any(p != q and p.is_relative_to(q) for q in roots)))


def _is_checkout(path: Path) -> bool:
    return path in _secret_paths() or (path / ".git").exists() or (path / "pyproject.toml").exists()


def _unshare_argv(inner: list[str], workdir: Path, limits: Limits) -> list[str]:
    return ["unshare", "-n", "--", *inner]


def _environment(workdir: Path) -> dict[str, str]:
    """A small allow-list: no keys or endpoints of the parent leak into the child."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "OMP_NUM_THREADS": "1",
           "USER": "sandbox", "LOGNAME": "sandbox",
           "TRITON_CACHE_DIR": str(workdir / ".triton"), "TORCHINDUCTOR_CACHE_DIR": str(workdir / ".inductor"),
           "PYTHONDONTWRITEBYTECODE": "1"}
    if "TRITON_INTERPRET" in os.environ:
        env["TRITON_INTERPRET"] = os.environ["TRITON_INTERPRET"]
    return env


def _confine(limits: Limits, cgroups: Cgroups):
    """Runs in the child between fork and exec: into the cgroups, then the rlimits."""
    processes_cap = None if cgroups.has("pids") else limits.processes + _tasks_of_uid(os.getuid())
    memory_cap = limits.memory_mib * MIB

    def apply() -> None:
        cgroups.join()
        resource.setrlimit(resource.RLIMIT_DATA, (memory_cap, memory_cap))
        if not cgroups.has("memory"):
            # no cgroup to count shared mappings: cap the address space itself
            resource.setrlimit(resource.RLIMIT_AS, (memory_cap, memory_cap))
        if processes_cap is not None:
            # counted per real uid (per user namespace on recent kernels): the tasks it already runs plus the cap
            resource.setrlimit(resource.RLIMIT_NPROC, (processes_cap, processes_cap))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mib * MIB, limits.file_mib * MIB))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _tasks_of_uid(uid: int) -> int:
    """Processes and threads this uid runs now (what RLIMIT_NPROC counts)."""
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - OUTPUT_TAIL))
        return f.read().decode("utf-8", "replace")
