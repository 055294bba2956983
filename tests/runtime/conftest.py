"""Packages of the tiny example releases, written once per session, for the runtime tests."""
from __future__ import annotations

import pytest
import torch

from onboard.package import write_package

# Tiny shapes on a shared 2-core machine: a second intra-op thread only spins (a 32x64 bf16 linear took
# 1.3 ms on two threads and 0.6 ms on one; in fp32, 10 ms on two and 34 us on one, under load).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def example_package(example_release, tmp_path_factory):
    """family -> package folder written by `onboard new-model` from the tiny release."""
    cache = {}

    def make(family: str):
        if family not in cache:
            cache[family], _ = write_package(example_release(family), tmp_path_factory.mktemp("pkg") / family)
        return cache[family]

    return make
