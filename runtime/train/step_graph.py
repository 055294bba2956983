"""Forward and backward of one micro-batch, replayed as a CUDA graph where that is legal.

A LoRA step at thin widths launches thousands of small kernels; a captured graph replays the whole
forward and backward with one launch, so the host never falls behind the GPU. Capture needs a fixed
batch shape and a step that never reads the device from the host:
that holds on one CUDA device for batches whose rows are each one segment (packed rows of several
documents split attention and conv per segment at host-read bounds), without the auxiliary loss
(its counts meet the loss between forward and backward). Anything else runs eagerly, and so does a
step whose capture fails; `reason` says why. Gradients accumulate in place into `.grad` tensors that
live across steps, so callers zero them with `set_to_none=False`.
"""
from __future__ import annotations

import contextlib
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

BATCH_KEYS = ("input_ids", "labels", "positions", "cu_seqlens")
RUNTIME_ROOT = Path(__file__).resolve().parents[1]


class MicroStep:
    """loss(batch) * scale, backward into the parameters' .grad; returns the detached loss."""

    def __init__(self, loss_fn: Callable[[dict], torch.Tensor], params: list[torch.nn.Parameter], use_graph: bool):
        self.loss_fn, self.params = loss_fn, params
        self.reason = None if use_graph else "off"
        self.graph, self.static, self.signature = None, None, None

    def __call__(self, batch: dict, scale: torch.Tensor) -> torch.Tensor:
        reason = self.reason or _eager_reason(batch)
        if reason is not None:
            return self._eager(batch, scale)
        if self.signature != _signature(batch):
            self._capture(batch, scale)
            if self.reason is not None:
                return self._eager(batch, scale)
        for key in BATCH_KEYS:
            self.static[key].copy_(batch[key])
        self.static["scale"].copy_(scale)
        self.graph.replay()
        return self.static["loss"].clone()

    @property
    def keeps_grads(self) -> bool:
        """True once a graph writes into the current .grad tensors: they must then never be freed."""
        return self.graph is not None

    def _eager(self, batch: dict, scale: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(batch) * scale
        loss.backward()
        return loss.detach()

    def _capture(self, batch: dict, scale: torch.Tensor) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        kept = [p.grad.clone() for p in self.params]
        static = {key: batch[key].clone() for key in BATCH_KEYS} | {"scale": scale.clone()}
        try:
            # lazy initialisation (Triton compiles, cuBLAS workspaces, autotuning) must not happen inside
            # the capture: one eager pass on a side stream first, as torch's graph docs prescribe
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), _syncs_raise():
                self._eager(static, static["scale"])
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static["loss"] = self._eager(static, static["scale"])
        except RuntimeError as error:
            self.reason = f"capture failed: {_first_cause(error)}"
        else:
            self.graph, self.static, self.signature = graph, static, _signature(batch)
        # neither the side-stream pass nor the capture may count towards this step's gradients
        for p, g in zip(self.params, kept):
            p.grad.copy_(g)


@contextlib.contextmanager
def _syncs_raise():
    """Host syncs raise in the warm-up pass, so a step that has one is found before a capture: a capture that
    fails on one leaves the CUDA generator's capture state behind, and later random ops then fail."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _first_cause(error: BaseException) -> str:
    """The error that broke the capture, with where it was raised: the capture's own exit error only says that
    an earlier one happened, and carries it as its context."""
    while error.__context__ is not None:
        error = error.__context__
    frames = traceback.extract_tb(error.__traceback__)
    # the deepest frame of the runtime names the op that did it; torch's own frames below it do not
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(RUNTIME_ROOT)] or frames
    where = f" at {Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else ""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0]}{where}"


def _signature(batch: dict) -> tuple:
    return tuple((key, tuple(batch[key].shape), batch[key].dtype) for key in BATCH_KEYS)


def _eager_reason(batch: dict) -> str | None:
    if batch["input_ids"].device.type != "cuda":
        return "not on a CUDA device"
    if dist.is_initialized():
        return "collectives (expert dispatch, FSDP) read split sizes on the host"
    if batch["cu_seqlens"].numel() != 2:
        return "packed rows of several documents are split per segment on the host"
    return None


def graph_allowed(device: torch.device, aux_loss_coef: float, offload: bool) -> bool:
    """Whether a trainer on this device with these settings may capture its micro-steps at all."""
    return device.type == "cuda" and aux_loss_coef == 0 and not offload
