"""Runs inside the sandbox before the candidate: `python -I sandbox_guard.py WORKDIR SCRIPT ARGS...`.

An audit hook refuses writes outside WORKDIR, sockets, subprocesses, ctypes and imports of the hidden packages.
`--no-guard` as the first argument skips the hook (tests show the OS confinement holding on its own).
Audit hooks are a tripwire, not a sandbox (ctypes can bypass them, which is why ctypes is refused); in bwrap mode
the operating system enforces the same rules underneath. A refusal is printed as `sandbox-refused: EVENT DETAIL`
on stderr for the report. Standalone on purpose: it is copied into the work dir, since its own folder is hidden.
"""
import os
import runpy
import sys

# the references a candidate is compared with and the model's own code (bwrap also hides them behind tmpfs)
HIDDEN_PACKAGES = ("reference_ops", "transformers", "onboard", "agents")
# every ctypes event, not only dlopen: torch has loaded ctypes before the hook, and ctypes.pythonapi (the
# interpreter's own symbols, libc's among them) reaches fork and system without opening a library
BLOCKED_EVENTS = ("socket.connect", "socket.bind", "socket.sendto", "subprocess.Popen", "os.system", "os.exec",
                  "os.posix_spawn", "os.fork", "os.forkpty", "pty.spawn", "ctypes.")
PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
WORKDIR = ""


def _inside(path) -> bool:
    if isinstance(path, int):
        return True
    real = os.path.realpath(os.fsdecode(path))
    return real == WORKDIR or real.startswith(WORKDIR + os.sep) or real.startswith("/dev/")


def _writes(mode, flags) -> bool:
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & WRITE_FLAGS)


def _refuse(event: str, detail) -> None:
    sys.stderr.write(f"sandbox-refused: {event} {detail!r}\n")
    raise PermissionError(f"sandbox: {event} refused")


def _hook(event: str, args) -> None:
    if event == "open" and _writes(args[1], args[2]) and not _inside(args[0]):
        _refuse(event, args[0])
    elif event in PATH_EVENTS and not _inside(args[0]):
        _refuse(event, args[0])
    elif event == "import" and args[0].split(".")[0] in HIDDEN_PACKAGES:
        _refuse(event, args[0])
    elif event.startswith(BLOCKED_EVENTS):
        _refuse(event, args[:1])


def main() -> None:
    global WORKDIR
    guarded = sys.argv[1] != "--no-guard"
    WORKDIR, script = os.path.realpath(sys.argv[1 + (not guarded)]), sys.argv[2 + (not guarded)]
    # torch loads its libraries through ctypes: imported before the hook, so candidates get torch but not ctypes
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    sys.path.insert(0, WORKDIR)
    sys.argv = [script, *sys.argv[3 + (not guarded):]]
    if guarded:
        sys.addaudithook(_hook)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
