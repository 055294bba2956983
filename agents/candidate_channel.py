"""The parent's end of the pipes to agents/harness.py: frames of a JSON header and, when the header says so,
safetensors bytes. What comes back is read as plain tensors only (safetensors holds no code and no objects),
within a size cap, and a header that is not a JSON object is refused."""
from __future__ import annotations

import json
from typing import IO

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

# far above any case's outputs (a few MiB): a child that sends more is refused, not read into memory
MAX_FRAME = 256 * 2**20


class ChildGone(Exception):
    """The child closed its end, died, or sent something that is not a frame of the protocol."""


class Channel:
    def __init__(self, to_child: IO[bytes], from_child: IO[bytes]):
        self.to_child, self.from_child = to_child, from_child

    def send(self, header: dict, tensors: dict[str, torch.Tensor] | None = None) -> None:
        frames = [json.dumps({**header, "tensors": bool(tensors)}).encode()]
        if tensors:
            frames.append(save_tensors({k: v.contiguous() for k, v in tensors.items()}))
        try:
            for frame in frames:
                self.to_child.write(len(frame).to_bytes(8, "little") + frame)
            self.to_child.flush()
        except (BrokenPipeError, OSError, ValueError) as err:
            raise ChildGone(f"the candidate's process stopped reading ({type(err).__name__})") from None

    def receive(self) -> tuple[dict, dict[str, torch.Tensor]]:
        try:
            header = json.loads(self._frame())
        except ValueError as err:
            raise ChildGone(f"the candidate's process sent a malformed header ({err})") from None
        if not isinstance(header, dict):
            raise ChildGone("the candidate's process sent a header that is not an object")
        if not header.get("tensors"):
            return header, {}
        try:
            return header, load_tensors(self._frame())
        except Exception as err:  # whatever the bytes are, they are only reported
            raise ChildGone(f"the candidate's process sent unreadable tensors ({type(err).__name__})") from None

    def _frame(self) -> bytes:
        size = int.from_bytes(self._exactly(8), "little")
        if size > MAX_FRAME:
            raise ChildGone(f"the candidate's process sent a frame of {size} bytes (at most {MAX_FRAME})")
        return self._exactly(size)

    def _exactly(self, size: int) -> bytes:
        data = self.from_child.read(size)
        if data is None or len(data) != size:
            raise ChildGone("the candidate's process ended before answering")
        return data
