"""The one op-comparison helper of the per-op test files."""
from __future__ import annotations

import torch

from runtime.tolerances import assert_close


def check_op(op, run_fn, ref_fn, inputs: dict, dtype: torch.dtype, **static):
    """Runtime in `dtype` vs reference in fp64 on the same (rounded) inputs: every output (one tensor or
    a tuple) and the gradients of all inputs, through one random cotangent per output."""
    run_in = {name: t.to(dtype).requires_grad_() for name, t in inputs.items()}
    ref_in = {name: t.detach().double().requires_grad_() for name, t in run_in.items()}
    run_out, ref_out = run_fn(**run_in, **static), ref_fn(**ref_in, **static)
    run_outs = run_out if isinstance(run_out, tuple) else (run_out,)
    ref_outs = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    assert run_outs[0].dtype == dtype, f"{op}: output dtype {run_outs[0].dtype}, expected {dtype}"
    cotangents = [torch.randn_like(r) for r in ref_outs]
    for i, (a, e) in enumerate(zip(run_outs, ref_outs)):
        assert_close(a, e, op, dtype, "out", f"output {i}")
    torch.autograd.backward(run_outs, [c.to(a.dtype) for c, a in zip(cotangents, run_outs)])
    torch.autograd.backward(ref_outs, cotangents)
    for name in inputs:
        assert run_in[name].grad is not None, f"{op}: no gradient reached {name}"
        assert_close(run_in[name].grad, ref_in[name].grad, op, dtype, "grad", name)


def check_route(route_fn, reference_route, logits: torch.Tensor, top_k: int, case: str, **kwargs) -> None:
    """A router (kernel or torch form) against the fp64 reference: same experts, weights and logit
    gradients within the route tolerance."""
    from runtime.tolerances import assert_close

    logits = logits.detach().requires_grad_()
    logits64 = logits.detach().double().requires_grad_()
    w_run, idx_run = route_fn(logits, top_k, **kwargs)
    w_ref, idx_ref = reference_route(logits64, top_k, **kwargs)
    assert w_run.dtype == torch.float32 and torch.equal(idx_run, idx_ref)
    assert_close(w_run, w_ref, "route", torch.float32, "out", case)
    cot = torch.randn_like(w_ref)
    w_run.backward(cot.float())
    w_ref.backward(cot)
    assert_close(logits.grad, logits64.grad, "route", torch.float32, "grad", case)

