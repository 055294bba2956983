"""The release's own code as the reference for tiers 1 and 2, run only inside the sandbox.

A release whose config.json `auto_map` names a model class of its own ships code, whatever its `model_type` says:
a copy of a known family with a changed router is aligned against ITS code, never transformers' class of the
family. That code is untrusted (CONVENTIONS 17): it runs in a child process under bubblewrap
(onboard/sandbox/run.py, run_project_module: no network, no home, the release read-only, a private /tmp, an
environment of a few allowed variables, CPU only, time and memory bounded), started with the module
onboard/align/release_worker.py, which loads the release with transformers' `trust_remote_code=True` there and
nowhere else. Tensors go in and come out through safetensors files in the child's private work folder; this
process reads back only the tensors it asked for, with the shapes it expects. A child that fails, times out or
writes something else is ReferenceFailed: the tier's failed check (exit 3 with the reason), never a crash.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from onboard import package_io
from onboard.errors import BadInput, printable
from onboard.release.model_source import model_entry

WORKER_MODULE = "onboard.align.release_worker"
REQUEST, INPUTS, OUTPUTS, RESULT, ERROR = ("request.json", "inputs.safetensors", "outputs.safetensors", "result.json",
                                           "error.json")
# what the child may know of the user's environment: the thread count, nothing else (it runs on the CPU)
PASSED_ENV = ("OMP_NUM_THREADS",)
MIB = 2**20
# logits of the largest vocabularies over a few short sequences, plus a few layers' activations and gradients
MAX_OUTPUT_BYTES = 4 << 30


class ReferenceFailed(RuntimeError):
    """The release's code gave no usable reference (failed, timed out, refused, or wrote something else)."""


def ships_code(source: Path) -> bool:
    """Whether the release's config names a model class of its own (auto_map): its code is then the reference."""
    try:
        config = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and model_entry(config) is not None


def reference_limits():
    """Bounded on every axis: an hour of wall time, at most half the machine's memory, CPU time for its cores."""
    from onboard.sandbox.run import Limits

    wall_s = int(os.environ.get("ONBOARD_REFERENCE_WALL_S", 3600))
    memory_mib = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20) // 2
    # never above what this process is held to (inside the confined alignment a limit cannot be raised)
    return Limits(wall_s=wall_s, memory_mib=_within(resource.RLIMIT_DATA, memory_mib, MIB),
                  cpu_s=_within(resource.RLIMIT_CPU, wall_s * (os.cpu_count() or 1)),
                  file_mib=_within(resource.RLIMIT_FSIZE, 8192, MIB), open_files=_within(resource.RLIMIT_NOFILE, 4096),
                  processes=512, shm_mib=512, tmp_mib=1024)


def _within(limit: int, value: int, unit: int = 1) -> int:
    hard = resource.getrlimit(limit)[1]
    return value if hard == resource.RLIM_INFINITY else min(value, hard // unit)


@dataclass
class Task:
    """One thing the worker computes: `logits` (whole model on `ids`, with each layer's, attention's and FFN's
    input and output when `record`), or `layers` (each of `layers` rerun on its recorded input, forward and
    backward with the cotangent of `seed`)."""
    kind: str
    tag: str
    dtype: str
    ids: str
    record: bool = False
    layers: tuple[int, ...] = ()
    seed: int = 0


class SandboxedReference:
    """The release's code, run in the sandbox on demand: `run(tasks, inputs)` -> (tensors, info)."""

    def __init__(self, source: Path, num_layers: int | None, limits=None, work_root: Path | None = None):
        self.source, self.num_layers = Path(source).resolve(), num_layers
        self.limits, self.work_root = limits, work_root

    def run(self, tasks: list[Task], inputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        from onboard.sandbox.run import available_mode

        if available_mode() != "bwrap":
            raise ReferenceFailed("the release ships its own code, and it runs only confined: no working bubblewrap "
                                  "here (install bubblewrap)")
        if self.work_root is not None:
            return self._run_in(Path(tempfile.mkdtemp(prefix="reference-", dir=self.work_root)), tasks, inputs)
        with tempfile.TemporaryDirectory(prefix="onboard-reference-") as tmp:
            return self._run_in(Path(tmp), tasks, inputs)

    def _run_in(self, work: Path, tasks: list[Task], inputs: dict[str, torch.Tensor]):
        from safetensors.torch import save_file

        from onboard.sandbox.run import run_project_module

        save_file({k: v.contiguous() for k, v in inputs.items()}, str(work / INPUTS))
        request = {"source": str(self.source), "num_layers": self.num_layers,
                   "tasks": [dict(vars(t), layers=list(t.layers)) for t in tasks]}
        (work / REQUEST).write_text(json.dumps(request))
        env = {key: os.environ[key] for key in PASSED_ENV if key in os.environ}
        # offline, and transformers' copy of the release's modules inside the work folder
        env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(work / ".hf"),
                "CUDA_VISIBLE_DEVICES": ""}
        try:
            result = run_project_module(WORKER_MODULE, [str(work / REQUEST)], work, readable=_readable(self.source),
                                        limits=self.limits or reference_limits(), env=env)
        except (OSError, subprocess.SubprocessError) as err:
            raise ReferenceFailed(f"the sandbox for the release's code did not start: {printable(str(err))[:200]}")
        return _outcome(work, result)


def _readable(release: Path) -> list[Path]:
    """The release, and the files its links point to (a hub cache's snapshot links into its blobs)."""
    targets = [entry.resolve() for entry in release.iterdir() if entry.is_symlink() and entry.resolve().exists()]
    return [release, *targets]


def _outcome(work: Path, result) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load

    info = _child_json(work / RESULT, 16 << 20)
    if not result.ok or not isinstance(info, dict):
        raise ReferenceFailed(f"the release's code, run confined, gave no reference ({_why(work, result)})")
    try:
        tensors = load(package_io.read_bytes(work, work / OUTPUTS, MAX_OUTPUT_BYTES))
    except (BadInput, ValueError, RuntimeError) as err:
        raise ReferenceFailed(f"the release's code, run confined, wrote no readable {OUTPUTS}: "
                              f"{printable(str(err))[:200]}") from None
    return tensors, info


def _why(work: Path, result) -> str:
    if result.timed_out:
        return f"timed out after {result.wall_s:.0f} s"
    error = _child_json(work / ERROR, 64 << 10)
    if isinstance(error, dict) and isinstance(error.get("error"), str):
        return printable(error["error"])[:400]
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "no output"
    return f"exit code {result.returncode}: {printable(last)[:300]}"


def _child_json(path: Path, limit: int):
    """A JSON file the child wrote into its work folder, read without following links; None when there is none."""
    try:
        return json.loads(package_io.read_bytes(path.parent, path, limit))
    except (BadInput, ValueError):
        return None


def expect(tensors: dict[str, torch.Tensor], key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The tensor `key` the worker was asked for, floating point and of `shape` when given; else ReferenceFailed."""
    value = tensors.get(key)
    if value is None or not value.is_floating_point():
        raise ReferenceFailed(f"the release's code gave no floating-point tensor {key!r}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ReferenceFailed(f"the release's code gave {key} of shape {tuple(value.shape)}, expected {tuple(shape)}")
    return value


class RecordedCalls:
    """What each of the release's layers, attentions and FFNs saw and gave (the worker's recording of a `logits`
    task), read like onboard/align/reference.py's Recorder."""

    def __init__(self, tensors: dict[str, torch.Tensor], tag: str):
        self.tensors, self.tag = tensors, tag

    def input(self, part: str, index: int) -> torch.Tensor:
        return expect(self.tensors, f"{self.tag}/{part}/{index}/in")

    def output(self, part: str, index: int) -> torch.Tensor:
        return expect(self.tensors, f"{self.tag}/{part}/{index}/out")

    def close(self) -> None:
        pass


def whole_model_truth(source: Path, num_layers: int | None, ids: torch.Tensor, reference: SandboxedReference | None = None
                      ) -> tuple[torch.Tensor, RecordedCalls, torch.Tensor]:
    """Tier 2's reference from the release's code in one confined run: fp32 logits with what each layer saw and
    gave, and bf16 logits."""
    reference = reference or SandboxedReference(source, num_layers)
    tasks = [Task(kind="logits", tag="float32", dtype="float32", ids="ids", record=True),
             Task(kind="logits", tag="bfloat16", dtype="bfloat16", ids="ids")]
    tensors, _ = reference.run(tasks, {"ids": ids})
    logits = [expect(tensors, f"{tag}/logits") for tag in ("float32", "bfloat16")]
    for value in logits:
        if tuple(value.shape[:2]) != tuple(ids.shape):
            raise ReferenceFailed(f"the release's code gave logits of shape {tuple(value.shape)} for token ids of "
                                  f"shape {tuple(ids.shape)}")
    return logits[0], RecordedCalls(tensors, "float32"), logits[1]


def require_runnable_here(spec, reference_ran: str) -> None:
    """Our side of the comparison builds nothing from the release's code: parts of a family transformers does not
    know, which only that code implements, stop here with what ran and what is missing."""
    from onboard.release.transformers_classes import transformers_knows

    own = [layer.index for layer in spec.layers
           if layer.own_layer or "own_module" in (layer.attention.kind, layer.ffn.kind)]
    if (own or spec.own_model) and not transformers_knows(spec.family):
        raise ReferenceFailed(f"the release's code ran confined ({reference_ran}); our side needs layers "
                              f"{own or 'all'} as its own modules (transformers does not know the family): that runs "
                              "its code in this process, which needs --trust-remote-code (not offered yet), or "
                              "registry ops for them")
