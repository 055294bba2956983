"""Which implementation of an op runs: its torch form ("torch"), its Triton kernels ("triton"), or its Triton
kernels with their Gluon twins for Hopper where the shapes fit ("hopper").

Each op with kernels has one `Selector` in its folder's backend.py. `runtime.dispatch.op` asks it whether a layer
gets the torch form or the kernel entry point, and the op's Gluon modules ask it whether they may run. A selector
decides once per (device, forced backend, interpreter) and logs that decision once, at INFO, on the logger of its
backend module (e.g. runtime.ops.moe.backend).

Unforced, a CUDA device with triton runs the kernels (with the Gluon twins on an sm_90 device, outside Triton's
interpreter) and anything else the torch form. `force` pins the choice for every op inside it, which is how alignment
tier 0 runs the torch forms and then the kernels on the same inputs: "torch" everywhere; "triton" the kernels
without Gluon, on any device (on the CPU through TRITON_INTERPRET=1); "hopper" the fastest fused path the device
has, i.e. "triton" where it is not a Hopper GPU.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Iterator, Literal, Optional

import torch

from runtime.ops.common.available import kernels_available
from runtime.ops.common.launch import interpreting

Backend = Literal["torch", "triton", "hopper"]
BACKENDS: tuple[Backend, ...] = ("torch", "triton", "hopper")

_forced: Optional[Backend] = None


@contextlib.contextmanager
def force(backend: Optional[Backend]) -> Iterator[None]:
    """Run every op inside through `backend` (None: each selector's own choice)."""
    global _forced
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    previous, _forced = _forced, backend
    try:
        yield
    finally:
        _forced = previous


@functools.cache
def is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


class Selector:
    """The backend choice of one op, made once per situation and logged once."""

    def __init__(self, module_name: str, backends: tuple[Backend, ...]):
        self.log = logging.getLogger(module_name)
        self.op = module_name.removeprefix("runtime.ops.").removesuffix(".backend")
        self.backends = backends
        self._chosen: dict[tuple, Backend] = {}

    def choose(self, device: torch.device | None) -> Backend:
        device = device if device is not None else torch.device("cpu")
        key = (device.type, device.index, _forced, interpreting())
        choice = self._chosen.get(key)
        if choice is None:
            choice = self._chosen[key] = self._decide(device)
            self.log.info("%s on %s: %s%s", self.op, device, choice, f" (forced {_forced})" if _forced else "")
        return choice

    def _decide(self, device: torch.device) -> Backend:
        if _forced == "torch" or not self._fused(device):
            return "torch"
        if _forced == "triton" or "hopper" not in self.backends:
            return "triton"
        on_hopper = device.type == "cuda" and not interpreting() and is_hopper(device.index or 0)
        return "hopper" if on_hopper else "triton"

    def _fused(self, device: torch.device) -> bool:
        """Whether the kernels run at all: forced, or unforced on a CUDA device with triton installed."""
        if "triton" not in self.backends:
            return False
        if _forced is not None:
            return True
        return device.type == "cuda" and kernels_available()[0]
