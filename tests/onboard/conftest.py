"""Packages written by `onboard new-model` from the session's example releases, cached per session."""
from __future__ import annotations

import pytest

from onboard.package import write_package


@pytest.fixture(scope="session")
def example_package(example_release, tmp_path_factory):
    """family -> package folder; tests that edit a package work on a copy."""
    cache = {}

    def make(family: str):
        if family not in cache:
            cache[family], _ = write_package(example_release(family), tmp_path_factory.mktemp("pkg") / family)
        return cache[family]

    return make
