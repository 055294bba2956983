"""The sandbox against real hostile children: each is a real process confined by the OS (bwrap where it starts,
else unshare -n), and the parent (this test) must survive and report what happened."""
from __future__ import annotations

import socket
import textwrap
import threading

import pytest

from agents.sandbox import Limits, available_mode, run_python

# every check in the strongest mode here; the containment checks also in the fallback mode
MODES = [available_mode()]
FALLBACK = ["unshare"] if available_mode() == "bwrap" else []


def _run(tmp_path, code: str, mode: str, limits: Limits = Limits(wall_s=30)):
    work = tmp_path / "work"
    work.mkdir()
    script = work / "candidate.py"
    script.write_text(textwrap.dedent(code))
    return run_python(script, work, limits=limits, mode=mode)


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


@pytest.mark.parametrize("mode", MODES + FALLBACK)
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


@pytest.mark.parametrize("mode", MODES + FALLBACK)
def test_a_write_outside_the_folder_fails_and_leaves_nothing(tmp_path, mode):
    outside = tmp_path / "outside.txt"
    result = _run(tmp_path, f"open({str(outside)!r}, 'w').write('escaped')\n", mode)
    assert not result.ok
    assert not outside.exists()


@pytest.mark.parametrize("mode", MODES + FALLBACK)
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
