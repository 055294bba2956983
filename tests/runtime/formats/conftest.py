"""Stored-format copies of the example releases (tests/runtime/formats/stored_release.py), written once a session."""
from __future__ import annotations

import json

import pytest

from runtime.formats.scheme import FP8Block, MXFP4
from tests.runtime.formats.stored_release import write_stored_release

# FP8 blocks small enough for the tiny examples' widths (64 columns = 24 + 24 + 16: a partial last block)
KINDS = {"fp8": FP8Block(block=(16, 24)), "mxfp4": MXFP4(layout="blocks"), "mxfp4_packed": MXFP4(layout="packed")}


@pytest.fixture(scope="session")
def stored_package(example_package, tmp_path_factory):
    """(family, kind) -> (spec dict, stored weight map, stored release folder, package folder of the bf16 release)."""
    cache = {}

    def make(family: str, kind: str):
        if (family, kind) not in cache:
            pkg = example_package(family)
            spec = json.loads((pkg / "spec.json").read_text())
            weight_map = json.loads((pkg / "weight_map.json").read_text())
            import yaml
            source = yaml.safe_load((pkg / "package.yaml").read_text())["source"]["absolute"]
            out = tmp_path_factory.mktemp("stored") / f"{family}-{kind}"
            stored_map = write_stored_release(source, spec, weight_map, KINDS[kind], out)
            cache[family, kind] = spec, stored_map, out, pkg
        return cache[family, kind]

    return make
