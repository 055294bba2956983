"""The sandbox against real hostile children: each is a real process confined by the OS (bwrap where it starts,
else unshare -n), and the parent (this test) must survive and report what happened."""
from __future__ import annotations

import json
import os
import socket
import textwrap
import threading
import time
from pathlib import Path

import pytest

from onboard.sandbox.run import Limits, available_mode, run_python

# every check in the strongest mode here; the containment checks also in the next weaker mode (unshare)
MODES = [available_mode()]
WEAKER = ["unshare"] if available_mode() == "bwrap" else []


def _run(tmp_path, code: str, mode: str, limits: Limits = Limits(wall_s=30), tripwire: bool = True):
    work = tmp_path / "work"
    work.mkdir()
    script = work / "candidate.py"
    script.write_text(textwrap.dedent(code))
    return run_python(script, work, limits=limits, mode=mode, tripwire=tripwire)


@pytest.fixture(params=MODES)
def mode(request):
    return request.param


def test_a_well_behaved_child_runs_and_writes_its_folder(tmp_path, mode):
    result = _run(tmp_path, "import torch\nopen('out.txt', 'w').write(str(torch.ones(2).sum().item()))\n", mode)
    assert result.ok, result.stderr
    assert result.mode == mode
    assert (tmp_path / "work" / "out.txt").read_text() == "2.0"


def test_a_hang_is_killed_at_the_wall_clock_limit(tmp_path, mode):
    result = _run(tmp_path, "while True:\n    pass\n", mode, Limits(wall_s=3))
    assert result.timed_out and not result.ok
    assert result.wall_s < 10


def test_unbounded_allocation_is_stopped(tmp_path, mode):
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 2**20))\n"
    result = _run(tmp_path, code, mode, Limits(wall_s=30, memory_mib=512))
    assert not result.ok and not result.timed_out
    assert "MemoryError" in result.stderr


@pytest.mark.parametrize("mode", MODES + WEAKER)
def test_a_socket_to_the_parent_cannot_connect(tmp_path, mode):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    port = server.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('connected')\n"
    result = _run(tmp_path, code, mode)
    server.close()
    assert not result.ok and "connected" not in result.stdout
    assert not accepted


@pytest.mark.parametrize("mode", MODES + WEAKER)
def test_a_write_outside_the_folder_fails_and_leaves_nothing(tmp_path, mode):
    outside = tmp_path / "outside.txt"
    result = _run(tmp_path, f"open({str(outside)!r}, 'w').write('escaped')\n", mode)
    assert not result.ok
    assert not outside.exists()


@pytest.mark.parametrize("mode", MODES + WEAKER)
def test_the_reference_ops_cannot_be_imported(tmp_path, mode):
    code = "import reference_ops.gated_delta\nprint('copied')\n"
    result = _run(tmp_path, code, mode)
    assert not result.ok and "copied" not in result.stdout


def test_a_grandchild_does_not_outlive_the_sandbox(tmp_path, mode):
    code = "import os\nos.system('sleep 30 &')\n"
    result = _run(tmp_path, code, mode)
    # the guard refuses os.system; under bwrap the pid namespace would end it anyway
    assert not result.ok
    assert "sandbox-refused: os.system" in result.stderr


# The hostile children below run without the audit-hook guard (a tripwire that code with native access could
# step past), so what stops them is the operating system's confinement alone. They reach libc through
# ctypes.pythonapi, the interpreter's own symbols, which the guard refuses when it is there (last test).
LIBC = "import ctypes\nlibc = ctypes.pythonapi\n"


@pytest.mark.parametrize("mode", MODES + WEAKER)
def test_a_fork_bomb_is_capped(tmp_path, mode):
    code = LIBC + textwrap.dedent("""
        import time
        started = 0
        for _ in range(200):
            pid = libc.fork()
            if pid == 0:
                time.sleep(20)
                libc._exit(0)
            started += pid > 0
        print("started", started, flush=True)
    """)
    result = _run(tmp_path, code, mode, Limits(wall_s=30, processes=32), tripwire=False)
    started = int(result.stdout.split("started")[1])
    assert result.ok, result.stderr
    assert started < 32


@pytest.mark.parametrize("how", [
    "import mmap\nm = mmap.mmap(-1, 1536 * 2**20, flags=mmap.MAP_SHARED)\n"
    "for i in range(0, len(m), 4096):\n    m[i] = 1\n",
    "chunk = b'x' * 2**20\nwith open('/dev/shm/bomb', 'wb') as f:\n    for _ in range(1536):\n        f.write(chunk)\n",
], ids=["shared-mapping", "dev-shm-file"])
def test_a_shared_memory_bomb_is_stopped_at_the_cap(tmp_path, mode, how):
    """Where cgroups can be made (this machine), the memory cgroup kills it; the rlimit cap without cgroups is below."""
    result = _run(tmp_path, how + "print('touched 1.5 GiB')\n", mode, Limits(wall_s=30, memory_mib=512),
                  tripwire=False)
    assert not result.ok and not result.timed_out
    assert "touched" not in result.stdout
    # killed by the memory cgroup, refused by the bounded /dev/shm, or (no cgroup) by RLIMIT_AS
    stopped_by = ("killed at the memory limit", "No space left", "MemoryError")
    assert any(s in result.stderr for s in stopped_by), result.stderr


def test_without_cgroups_the_address_space_cap_refuses_the_shared_mapping(tmp_path, monkeypatch):
    """A machine where no cgroup can be made (stood in for by an empty Cgroups: the real absence needs another
    machine): RLIMIT_AS caps the address space, so a 1.5 GiB shared mapping is refused at 1 GiB."""
    from onboard.sandbox import run as sandbox
    from onboard.sandbox.cgroups import Cgroups

    monkeypatch.setattr(sandbox.Cgroups, "create", classmethod(lambda cls, processes, memory_bytes: Cgroups()))
    code = "import mmap\nm = mmap.mmap(-1, 1536 * 2**20, flags=mmap.MAP_SHARED)\nprint('mapped')\n"
    result = _run(tmp_path, code, available_mode(), Limits(wall_s=30, memory_mib=1024), tripwire=False)
    assert not result.ok and "mapped" not in result.stdout
    assert "Cannot allocate memory" in result.stderr, result.stderr


@pytest.mark.parametrize("mode", MODES + WEAKER)
def test_a_detached_daemon_does_not_survive_the_run(tmp_path, mode):
    marker = tmp_path / "work" / "survived.txt"
    # the grandchild writes only once the run's main process is gone, and a second later: a marker means it
    # outlived the run, never that the run was slow to end
    code = LIBC + textwrap.dedent(f"""
        import os, time
        main = os.getpid()
        if libc.fork() == 0:
            libc.setsid()
            if libc.fork() == 0:
                while os.path.exists(f"/proc/{{main}}"):
                    time.sleep(0.05)
                time.sleep(1)
                open({str(marker)!r}, "w").write("survived")
                libc._exit(0)
            libc._exit(0)
        time.sleep(0.5)
        print("detached")
    """)
    result = _run(tmp_path, code, mode, tripwire=False)
    assert result.ok and "detached" in result.stdout, result.stderr
    time.sleep(3)
    assert not marker.exists()


@pytest.mark.skipif(available_mode() != "bwrap", reason="only bubblewrap hides paths; unshare -n hides none")
def test_the_project_the_home_and_other_processes_are_not_visible(tmp_path):
    from onboard.sandbox.run import REPO, _git_dirs, _interpreter_roots

    home = Path.home()
    targets = [REPO / "agents" / "validate.py", REPO / "reference_ops", *[d / "objects" for d in _git_dirs(REPO)],
               home, Path(f"/proc/{os.getpid()}/cwd")]
    code = textwrap.dedent(f"""
        import json, os
        seen = {{}}
        for path in {[str(t) for t in targets]!r}:
            if os.path.isdir(path):
                seen[path] = sorted(os.listdir(path))
            elif os.path.exists(path):
                seen[path] = open(path).read(40)
        cwds = {{}}
        for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
            cwds[pid] = os.readlink(f"/proc/{{pid}}/cwd")
        print(json.dumps({{"seen": seen, "cwds": cwds}}))
    """)
    result = _run(tmp_path, code, "bwrap", tripwire=False)
    assert result.ok, result.stderr
    found = json.loads(result.stdout)
    # the home is there only as the folders leading to an interpreter installed under it, if any
    route = sorted({r.relative_to(home).parts[0] for r in _interpreter_roots() if r.is_relative_to(home)})
    assert found["seen"].pop(str(home), []) == route
    assert found["seen"] == {}
    # the sandbox's own init and the child, both in the work dir: no other process of the machine
    assert len(found["cwds"]) <= 2 and set(found["cwds"].values()) == {str(tmp_path / "work")}


@pytest.mark.parametrize("mode", MODES + WEAKER)
def test_the_guard_refuses_libc_through_the_interpreters_own_symbols(tmp_path, mode):
    result = _run(tmp_path, LIBC + "libc.system(b'true')\nprint('ran')\n", mode)
    assert not result.ok and "ran" not in result.stdout
    assert "sandbox-refused: ctypes." in result.stderr
