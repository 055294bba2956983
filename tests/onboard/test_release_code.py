"""Code that came with a release never runs in onboard's process without --trust-remote-code (CONVENTIONS 17).

A real tiny release (the example families' writer, what `onboard example-model` runs) gets an `auto_map` in
config.json and tokenizer_config.json naming configuration, modeling and tokenization files shipped beside the
weights; each writes a marker file when imported. Every command runs on it as a user runs it (a subprocess of
the `onboard` entry point): none may leave the marker or a traceback. A control first shows that transformers
does import those files when told to trust them, so a missing marker means the code was refused, not broken.
The Kimi K3-shaped example (a design only its own code builds) gets the same treatment: inspect, new-model,
align, train and export with no flag leave no marker. The guard below keeps every transformers loader call in
onboard/, runtime/, agents/, bench/ and reference_ops/ explicit about it.
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
FAMILY = "qwen3_moe"

# Each file writes the marker when imported, then defines a class transformers would use.
RELEASE_CODE = {
    "configuration_evil.py": "from transformers import Qwen3MoeConfig\n\n\nclass EvilConfig(Qwen3MoeConfig):\n    pass\n",
    "modeling_evil.py": ("from transformers import Qwen3MoeForCausalLM\n\n\n"
                         "class EvilForCausalLM(Qwen3MoeForCausalLM):\n    pass\n"),
    "tokenization_evil.py": ("from transformers import PreTrainedTokenizerFast\n\n\n"
                             "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"),
}
MARKER_LINES = "import os\nimport pathlib\n\npathlib.Path(os.environ['ONBOARD_TEST_MARKER']).write_text(__name__)\n"
AUTO_MAP = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModel": "modeling_evil.EvilForCausalLM",
            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2))


def _with_code(release: Path, **config_changes) -> Path:
    for name, body in RELEASE_CODE.items():
        (release / name).write_text(MARKER_LINES + body)
    _edit_json(release / "config.json", auto_map=AUTO_MAP, **config_changes)
    _edit_json(release / "tokenizer_config.json", auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]})
    return release


@pytest.fixture(scope="module")
def code_release(example_release, tmp_path_factory) -> Path:
    """A family transformers knows, shipping its own code too: transformers' class runs, never the release's."""
    return _with_code(Path(shutil.copytree(example_release(FAMILY), tmp_path_factory.mktemp("code") / "release")))


@pytest.fixture(scope="module")
def own_design_release(example_release, tmp_path_factory) -> Path:
    """A family transformers does not know (model_type renamed): only the release's code could build its model,
    as for a release of a new design (the K3 shape); without trust its layers cannot be checked against it."""
    release = Path(shutil.copytree(example_release(FAMILY), tmp_path_factory.mktemp("own") / "release"))
    return _with_code(release, model_type="acme_moe")


@pytest.fixture(scope="module")
def k3_marked_release(kimi_k3_release, tmp_path_factory) -> Path:
    """The Kimi K3-shaped example (onboard/examples/kimi_k3: a design transformers has no class for, whose own
    configuration and modeling files auto_map names) with those files writing the marker when imported, and a
    tokenizer class of its own as well."""
    release = Path(shutil.copytree(kimi_k3_release("bf16"), tmp_path_factory.mktemp("k3") / "release"))
    for name in ("configuration_kimi_k3.py", "modeling_kimi_k3.py"):
        source = (release / name).read_text()
        # after the module docstring and its __future__ import, which must stay first
        head, future, rest = source.partition("from __future__ import annotations\n")
        (release / name).write_text(head + future + MARKER_LINES + rest)
    (release / "tokenization_evil.py").write_text(MARKER_LINES + RELEASE_CODE["tokenization_evil.py"])
    _edit_json(release / "tokenizer_config.json", auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]})
    return release


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """The subprocesses' environment: the marker's path, and a Hugging Face home of their own (transformers
    copies trusted release code into its modules cache there)."""
    home = tmp_path_factory.mktemp("hf")
    return {**os.environ, "ONBOARD_TEST_MARKER": str(home / "marker"), "HF_HOME": str(home), "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _marker(env: dict[str, str]) -> Path:
    return Path(env["ONBOARD_TEST_MARKER"])


def test_the_release_code_runs_when_trusted(code_release, env):
    """The control: transformers imports the release's files when told to trust them."""
    loads = ("from transformers import AutoConfig, AutoTokenizer; import sys; "
             "AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True); "
             "AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)")
    done = subprocess.run([sys.executable, "-c", loads, str(code_release)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _marker(env).exists()
    _marker(env).unlink()


def _onboard(env: dict[str, str], *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onboard.cli", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=600)


def _run_all(env: dict[str, str], steps: list[tuple[tuple, tuple[int, ...]]]) -> None:
    """Each command in turn, as a subprocess: its exit code among those allowed, no traceback, no marker."""
    _marker(env).unlink(missing_ok=True)
    for args, codes in steps:
        done = _onboard(env, *args)
        said = done.stdout[-1000:] + done.stderr[-2000:]
        assert done.returncode in codes and "Traceback" not in done.stdout + done.stderr, (args[0], done.returncode, said)
        assert not _marker(env).exists(), f"{args[0]} imported {_marker(env).read_text()} from the release"


def test_no_command_runs_the_release_code(code_release, env, tmp_path):
    """inspect, plan, new-model, align, train, export and bench, none with --trust-remote-code: no marker, no
    traceback, each ends as it does for a release without code (transformers' own classes of the family)."""
    pkg, run, data = tmp_path / "pkg", tmp_path / "run", tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"The mill number {i} turns by the river."}) + "\n" for i in range(8)))
    steps = [
        (("inspect", code_release), (0, 3)),
        (("plan", code_release, "--gpus", "8", "--gpu-mem-gib", "80"), (0, 3)),
        (("new-model", code_release, "--out", pkg), (0, 3)),
        # tiers 1 and 2 run the release's code, confined (tests/onboard/test_release_reference.py): the sandbox's
        # environment has no ONBOARD_TEST_MARKER, so its import fails there and the tier fails (exit 3)
        (("align", pkg, "--tiers", "1,2"), (0, 3)),
    ]
    _run_all(env, steps)
    # the sandboxed reference cannot import the marked code (above), so the package is not `trainable` and train
    # and bench would refuse it at once; what is tested here is which code they run, so the status alignment
    # records for this release where its code imports is set by hand
    _edit_status(pkg / "package.yaml", "trainable")
    steps = [
        (("train", pkg, "--data", data, "--steps", "1", "--seq-len", "16", "--out", run, "--no-progress",
          "--no-cuda-graph"), (0,)),
        (("export", run, "--peft", tmp_path / "peft"), (0,)),
        (("bench", pkg, "--seq-len", "16", "--steps", "1"), (0,)),
    ]
    _run_all(env, steps)


def _edit_status(package_yaml, status: str) -> None:
    manifest = yaml.safe_load(package_yaml.read_text())
    package_yaml.write_text(yaml.safe_dump({**manifest, "status": status, "reasons": []}, sort_keys=False))


def test_a_release_only_its_own_code_could_build_is_a_gap(own_design_release, env, tmp_path):
    """inspect, plan and new-model on it: no marker, no traceback. new-model's tier 1 has no transformers model
    to compare with, and no demotion to its modules: exit 3 (a demotion asked for them: exit 1)."""
    steps = [(("inspect", own_design_release), (0, 3)),
             (("plan", own_design_release, "--gpus", "8", "--gpu-mem-gib", "80"), (0, 3)),
             (("new-model", own_design_release, "--out", tmp_path / "pkg"), (3,))]
    _run_all(env, steps)


def test_k3_shaped_release_code_runs_when_trusted(k3_marked_release, env):
    """The control: the marked files are the ones transformers runs when trusted."""
    loads = ("from transformers import AutoConfig; import sys; "
             "AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)")
    done = subprocess.run([sys.executable, "-c", loads, str(k3_marked_release)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _marker(env).exists()
    _marker(env).unlink()


def test_no_command_runs_a_k3_shaped_release_code(k3_marked_release, env, tmp_path):
    """inspect, new-model, align, train and export with no flag, on a release only its own code could build: no
    marker, no traceback, each with the exit it has today (gaps: 3; export of the run train refused to make: 2)."""
    pkg, run, data = tmp_path / "pkg", tmp_path / "run", tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"The mill number {i} turns by the river."}) + "\n" for i in range(8)))
    steps = [
        (("inspect", k3_marked_release), (3,)),
        (("new-model", k3_marked_release, "--out", pkg), (3,)),
        (("align", pkg), (3,)),
        (("train", pkg, "--data", data, "--steps", "1", "--seq-len", "16", "--out", run, "--no-progress"), (3,)),
        (("export", run, "--peft", tmp_path / "peft"), (2,)),
    ]
    _run_all(env, steps)


# Loader calls that read only weights and JSON, never code: they take no trust_remote_code.
NO_CODE_LOADERS = {"PeftModel"}
LOADER_METHODS = {"from_pretrained", "from_config"}


def _receiver(func: ast.Attribute) -> str:
    value = func.value
    return value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else ""


def _loader_calls_without_the_flag(source: str) -> list[int]:
    """Lines of calls `X.from_pretrained(...)` / `X.from_config(...)` / `pipeline(...)` with no explicit
    `trust_remote_code=` keyword (a `**kwargs` does not count: the reader cannot see it)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        loader = name == "pipeline" or (name in LOADER_METHODS and _receiver(func) not in NO_CODE_LOADERS)
        if loader and not any(k.arg == "trust_remote_code" for k in node.keywords):
            lines.append(node.lineno)
    return lines


def test_every_loader_call_says_trust_remote_code():
    missing = [f"{path.relative_to(ROOT)}:{line}"
               for folder in ("onboard", "runtime", "agents", "bench", "reference_ops") for path in sorted((ROOT / folder).rglob("*.py"))
               for line in _loader_calls_without_the_flag(path.read_text())]
    assert not missing, f"transformers loader calls without an explicit trust_remote_code=: {missing}"


def test_the_guard_sees_a_call_without_the_flag():
    source = ("AutoConfig.from_pretrained(p)\nmodel_class(f).from_pretrained(p, trust_remote_code=False)\n"
              "AutoModel.from_config(c, **kw)\nPeftModel.from_pretrained(m, d)\ntransformers.pipeline('x')\n")
    assert _loader_calls_without_the_flag(source) == [1, 3, 5]
