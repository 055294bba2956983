"""Runs inside the sandbox: `python harness.py CANDIDATE CASES...` (standalone: agents/ is hidden there).

For each case file (inputs and a cotangent, written by the parent) it calls the candidate's `op` twice,
back-propagates the cotangent, and saves the outputs, gradients and the inputs as they are afterwards to
`<case>.out.pt`. It compares nothing: the reference lives in the parent, which reads these files back.
"""
import runpy
import sys

import torch


def run_case(op, path: str) -> None:
    case = torch.load(path, weights_only=True)
    inputs = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in case["inputs"].items()}
    out = op(**inputs)
    again = op(**{k: v.detach().clone() for k, v in case["inputs"].items()})
    result = {"out": out.detach().clone() if isinstance(out, torch.Tensor) else None,
              "again": again.detach().clone() if isinstance(again, torch.Tensor) else None,
              "type": type(out).__name__, "grads": {}, "after": {k: v.detach() for k, v in inputs.items()}}
    if isinstance(out, torch.Tensor) and out.requires_grad and out.shape == case["cotangent"].shape:
        (out.double() * case["cotangent"].double()).sum().backward()
        result["grads"] = {k: v.grad for k, v in inputs.items() if v.grad is not None}
    torch.save(result, path.replace(".pt", ".out.pt"))


def main() -> None:
    op = runpy.run_path(sys.argv[1])["op"]
    for path in sys.argv[2:]:
        run_case(op, path)


if __name__ == "__main__":
    main()
