"""Shared fixtures of the onboard tests: packages written from the example releases, and the
`onboard` command run in this process with the bounds the reliability tests hold it to.

In-process so that hundreds of hostile inputs cost no interpreter start each; it is the same
`main` a user's `onboard` runs, with stdout and stderr captured. Memory is the growth of the
process's resident set, sampled every 20 ms by a thread (tracemalloc would slow torch's import
a hundredfold and miss native allocations). Time is the CPU time the command spent (this process and
the child processes it waited for), a measure of its work: wall-clock time depends on whatever else
runs on the machine (a 1.5 s test took 4.5 s beside another suite), CPU time on what the command did.

The fuzz tests take their example count from ONBOARD_FUZZ_EXAMPLES (default 12, for CI; the
issue's done-when runs 500 each: `ONBOARD_FUZZ_EXAMPLES=500 pytest tests/onboard/test_fuzz_*.py
--hypothesis-show-statistics` prints the exit-code counts), seeds random per run.
"""
from __future__ import annotations

import contextlib
import json
import io
import os
import shutil
import resource
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from onboard.cli import main

settings.register_profile("onboard-fuzz", max_examples=int(os.environ.get("ONBOARD_FUZZ_EXAMPLES", "12")),
                          deadline=None, database=None, suppress_health_check=list(HealthCheck))

# The done-when: no spin over 30 s of CPU (a quadratic scan, a runaway loop), no memory over 2 GiB.
CPU_LIMIT_S = 30.0
MEMORY_LIMIT_BYTES = 2 << 30


@dataclass
class CliRun:
    code: int
    out: str
    err: str
    cpu_seconds: float
    peak_bytes: int

    def assert_bounded(self) -> None:
        """Exit 0, 2 or 3, one line on stderr at most for 2, no traceback, within time and memory."""
        assert self.code in (0, 2, 3), (self.code, self.err[-2000:])
        assert "Traceback" not in self.err and "Traceback" not in self.out, self.err[-2000:]
        if self.code == 2:
            assert len(self.err.strip().splitlines()) == 1, self.err
        assert self.cpu_seconds < CPU_LIMIT_S, self.cpu_seconds
        assert self.peak_bytes < MEMORY_LIMIT_BYTES, self.peak_bytes


PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class _PeakRss:
    """Highest resident set seen while the block runs, above what it was at the start."""

    def __enter__(self):
        self.start = self.peak = _rss()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done.wait(0.02):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, _rss())
        self.growth = self.peak - self.start


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_onboard(*args: str) -> CliRun:
    out, err = io.StringIO(), io.StringIO()
    start = _cpu_seconds()
    with _PeakRss() as memory, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return CliRun(code, out.getvalue(), err.getvalue(), _cpu_seconds() - start, memory.growth)


@pytest.fixture(scope="session")
def onboard_cli():
    """run(*args) -> CliRun: `onboard ARGS` in this process, its CPU time counted, resident-set growth sampled."""
    return run_onboard


def copy_release(source: Path, target: Path) -> Path:
    """A release folder to break: JSON files copied, shards hard-linked (cheap). A test that
    changes a shard must replace the file (unlink, write), never write into it."""
    target.mkdir(parents=True)
    for path in source.iterdir():
        if path.suffix == ".safetensors":
            os.link(path, target / path.name)
        else:
            shutil.copy(path, target / path.name)
    return target


@pytest.fixture(scope="session")
def release_copy():
    """copy(source, target) -> target: see copy_release."""
    return copy_release


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """family -> (release folder, package folder) of any MoE family of the installed transformers, built tiny
    the way the family sweep builds it (onboard/family_sweep.py), cached per session."""
    from onboard.examples.models import save_release
    from onboard.family_sweep import build_tiny
    from onboard.package.writer import write_package

    cache: dict[str, tuple[Path, Path]] = {}

    def make(family: str) -> tuple[Path, Path]:
        if family not in cache:
            root = tmp_path_factory.mktemp("tiny") / family
            release = save_release(build_tiny(family)[0], root / "release", num_shards=2)
            cache[family] = release, write_package(release, root / "pkg")[0]
        return cache[family]

    return make


@pytest.fixture(scope="session")
def onboarded_package(example_release, tmp_path_factory):
    """`onboard new-model` (the whole graph, tiers 0-2 and tier 4 on paper for its plan's 8 GPUs) on the tiny
    qwen3_next release, once per session: (exit code, PKG). Tests that change the package work on a copy."""
    pkg = tmp_path_factory.mktemp("onboarded") / "qwen3_next"
    return run_onboard("new-model", example_release("qwen3_next"), "--out", pkg, "--tiers", "0,1,2,4").code, pkg


@pytest.fixture(scope="session")
def index_only_gap_release(example_release, tmp_path_factory) -> Path:
    """Mixtral's config and weight index without expert 3 (no shards): a valid release with gaps, exit 3."""
    release = tmp_path_factory.mktemp("gap-release") / "mixtral-no-expert-3"
    release.mkdir()
    source = example_release("mixtral")
    shutil.copy(source / "config.json", release / "config.json")
    index = json.loads((source / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if ".experts.3." not in k}
    (release / "model.safetensors.index.json").write_text(json.dumps(index))
    return release
