"""Runs inside the sandbox: `python harness.py CANDIDATE` (standalone: agents/ is hidden there).

It talks to the parent only through its stdin and stdout pipes, in frames (8-byte length, then bytes): a JSON
header, then safetensors bytes when the header says so. The parent asks it to load the candidate under a given
`sys.argv` (as `train` or `new-model` would run), then sends cases (inputs and a cotangent) it draws only after
the candidate is loaded; for each, the harness calls `op` twice, back-propagates the cotangent and sends back
the output, the second call's output, the inputs as they are afterwards and the input gradients. It compares
nothing: the reference and the verdict live in the parent. The functions it talks through are bound before the
candidate runs, so a candidate patching torch.save, safetensors or os changes nothing here, and the candidate's
own prints go to stderr: the pipes are the harness's alone.
"""
import json
import os
import runpy
import sys

import torch
from safetensors.torch import load as _load_tensors
from safetensors.torch import save as _save_tensors

_read, _write, _dumps, _loads, _from_bytes = os.read, os.write, json.dumps, json.loads, int.from_bytes


def _private_pipes() -> tuple[int, int]:
    """The pipes moved to fds of the harness's own; fd 0 reads nothing and fd 1 writes to stderr."""
    into, out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)
    return into, out


def _exactly(fd: int, size: int) -> bytes:
    chunks = []
    while size:
        chunk = _read(fd, min(size, 1 << 20))
        if not chunk:
            raise SystemExit(0)  # the parent closed the pipe: nothing more to do
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _receive(fd: int) -> tuple[dict, dict]:
    header = _loads(_exactly(fd, _from_bytes(_exactly(fd, 8), "little")))
    tensors = _load_tensors(_exactly(fd, _from_bytes(_exactly(fd, 8), "little"))) if header.get("tensors") else {}
    return header, tensors


def _send(fd: int, header: dict, tensors: dict) -> None:
    frames = [_dumps({**header, "tensors": bool(tensors)}).encode()] + ([_save_tensors(tensors)] if tensors else [])
    for frame in frames:
        data = len(frame).to_bytes(8, "little") + frame
        while data:
            data = data[_write(fd, data):]


def run_case(op, tensors: dict) -> tuple[dict, dict]:
    inputs = {k.removeprefix("input."): v for k, v in tensors.items() if k.startswith("input.")}
    leaves = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    out = op(**leaves)
    again = op(**{k: v.clone() for k, v in inputs.items()})
    result = {f"after.{k}": v.detach().clone().contiguous() for k, v in leaves.items()}
    for name, value in (("out", out), ("again", again)):
        if isinstance(value, torch.Tensor):
            result[name] = value.detach().clone().contiguous()
    cotangent = tensors["cotangent"]
    if isinstance(out, torch.Tensor) and out.requires_grad and out.shape == cotangent.shape:
        (out.double() * cotangent.double()).sum().backward()
        result.update({f"grad.{k}": v.grad.clone().contiguous() for k, v in leaves.items() if v.grad is not None})
    return {"type": type(out).__name__}, result


def main() -> None:
    into, out = _private_pipes()
    candidate, op = sys.argv[1], None
    while True:
        header, tensors = _receive(into)
        if header["do"] == "load":
            sys.argv = list(header["argv"])
            op = runpy.run_path(candidate)["op"]
            _send(out, {"ready": True}, {})
        elif header["do"] == "case":
            _send(out, *run_case(op, tensors))
        else:
            return


if __name__ == "__main__":
    main()
