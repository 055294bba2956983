"""Shared fixtures: tiny released-model folders of real families, written once per test session."""
from __future__ import annotations

import json
import lzma
import os
import shutil
from pathlib import Path

import pytest

from runtime.ops.common.available import kernels_available

# Triton picks the interpreter when a kernel is defined, at its module's import: without a CUDA GPU the flag is
# set here, before any test file (or what it imports) defines a kernel, whatever order the files load in
if not kernels_available()[0]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from onboard.examples.models import write_example_model  # noqa: E402
from onboard.package.writer import write_package  # noqa: E402
from runtime.package_ops import tables_restored  # noqa: E402

SEED_DIR = Path(__file__).resolve().parents[2] / "shared" / "examples" / "seed-2.8t"
# A copy of the seed example (index xz-compressed) for machines without ../shared.
SEED_COPY = Path(__file__).resolve().parent / "data" / "seed-2.8t"


@pytest.fixture(scope="session", autouse=True)
def _approvals_stay_out_of_home(tmp_path_factory):
    """The approved-ops store (onboard/package/approved_ops.py) of this test session, never the user's: set before any
    session fixture runs `new-model` (which approves what it generates); subprocesses inherit it."""
    saved = os.environ.get("ONBOARD_STATE_DIR")
    os.environ["ONBOARD_STATE_DIR"] = str(tmp_path_factory.mktemp("onboard-state"))
    yield
    if saved is None:
        os.environ.pop("ONBOARD_STATE_DIR", None)
    else:
        os.environ["ONBOARD_STATE_DIR"] = saved


@pytest.fixture(autouse=True)
def _generated_ops_stay_in_their_test():
    """A package's generated ops register into process-wide tables (one package per CLI process); a test
    that loads a package in-process must not leave its ops to the next test on the same worker."""
    with tables_restored():
        yield


@pytest.fixture(scope="session")
def example_release(tmp_path_factory):
    """family -> folder written by transformers' save_pretrained (2 shards, bf16), cached per session."""
    cache: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in cache:
            out = tmp_path_factory.mktemp("releases") / family
            cache[family] = write_example_model(family, out, num_shards=2)
        return cache[family]

    return make


@pytest.fixture(scope="session")
def stored_example_release(tmp_path_factory):
    """(family, weights) -> the example in the stored format its real release ships (`example-model --weights`:
    fp8 for deepseek_v3 / deepseek_v32 / qwen3_next, mxfp4 for gpt_oss), 2 shards, seed 0 like example_release:
    the same weights up to quantization."""
    cache: dict[tuple[str, str], Path] = {}

    def make(family: str, weights: str) -> Path:
        if (family, weights) not in cache:
            out = tmp_path_factory.mktemp("stored-releases") / f"{family}-{weights}"
            cache[family, weights] = write_example_model(family, out, num_shards=2, weights=weights)
        return cache[family, weights]

    return make


@pytest.fixture(scope="session")
def kimi_k3_release(tmp_path_factory):
    """weights ("bf16" | "mxfp4") -> the tiny Kimi K3-shaped custom-code release (2 shards), cached per session."""
    from onboard.examples.kimi_k3.writer import write_kimi_k3_release

    cache: dict[str, Path] = {}

    def make(weights: str = "bf16") -> Path:
        if weights not in cache:
            cache[weights] = write_kimi_k3_release(tmp_path_factory.mktemp("kimi_k3") / weights, 2, weights=weights)
        return cache[weights]

    return make


@pytest.fixture(scope="session")
def example_spec(example_release):
    """family -> the dict a package's spec.json holds for that family's example release (recognized once)."""
    from onboard.recognize.recognizer import recognize
    from onboard.release.manifest import read_manifest

    cache: dict[str, dict] = {}

    def make(family: str) -> dict:
        if family not in cache:
            cache[family] = json.loads(recognize(read_manifest(example_release(family))).model_dump_json())
        return cache[family]

    return make


@pytest.fixture(scope="session")
def example_package(example_release, tmp_path_factory):
    """family -> package folder written by `onboard new-model`; tests that edit a package work on a copy."""
    cache = {}

    def make(family: str):
        if family not in cache:
            cache[family], _ = write_package(example_release(family), tmp_path_factory.mktemp("pkg") / family)
        return cache[family]

    return make


@pytest.fixture(scope="session")
def seed_dir(tmp_path_factory) -> Path:
    """The 2.81T-parameter example: config and weight index only, no tensor data."""
    if SEED_DIR.exists():
        return SEED_DIR
    out = tmp_path_factory.mktemp("seed-2.8t")
    shutil.copy(SEED_COPY / "config.json", out / "config.json")
    with lzma.open(SEED_COPY / "model.safetensors.index.json.xz") as src:
        (out / "model.safetensors.index.json").write_bytes(src.read())
    return out



@pytest.fixture(scope="session")
def seed_spec(seed_dir):
    """The seed example's ModelSpec (recognized once per session)."""
    from onboard.recognize.recognizer import recognize
    from onboard.release.manifest import read_manifest

    return recognize(read_manifest(seed_dir))
