"""Alignment tier 0: every op the package uses, runtime forms vs the fp64 reference, forward and backward.

Each op runs at the real widths of the first layer that uses it, a short sequence, three seeds,
in fp32 and bf16; the torch form always, the fused kernel where it can run (CUDA, or the Triton
interpreter when TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from onboard.align.progress import Progress
from onboard.align.report import Check, with_scales
from onboard.align.tiers.cases import build_case
from onboard.align.tiers.stored_cases import stored_cases
from runtime import dispatch
from runtime.ops.common.backend import force
from runtime.registry import OPS, SpecPart, StoredWeights, ops_for_layer
from runtime.spec import ModelSpec
from runtime.tolerances import compare, tolerance_for

SEEDS = (0, 1, 2)
COTANGENT_SEED_OFFSET = 7919
DTYPES = (torch.float32, torch.bfloat16)
# tier 0's two runs of an op, as the backend selectors name them: its torch form, and the fastest fused path this
# device has (the Triton kernels, with their Gluon twins on a Hopper GPU)
BACKEND_OF = {"torch_form": "torch", "kernel": "hopper"}
# Ops whose output is a selection (indices): compared as sets, not numerically.
SELECTION_OPS = {"dsa_indexer"}


def _call_args(kwargs: dict, grads: list[str], dtype: torch.dtype | None, device: str = "cpu", frozen=()):
    """Leaf tensors (requires_grad where compared), re-nesting dotted names into dict arguments ("params.q_proj") and
    tuple arguments ("lora.0", "lora.1"); `frozen` tensors keep their dtype (a release's stored codes and scales)."""
    leaves, call = {}, {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().clone().to(device)
            if dtype is not None and value.is_floating_point() and name not in frozen:
                value = value.to(dtype)
            if name in grads:
                value.requires_grad_(True)
            leaves[name] = value
        if "." in name:
            outer, inner = name.split(".", 1)
            call.setdefault(outer, {})[inner] = value
        else:
            call[name] = value
    return {k: _as_tuple(v) for k, v in call.items()}, leaves


def _as_tuple(value):
    """A dict argument whose keys are 0..n-1 is a tuple argument (a LoRA pair)."""
    if isinstance(value, dict) and value and all(k.isdigit() for k in value):
        return tuple(value[str(i)] for i in range(len(value)))
    return value


def _outputs(result) -> list[torch.Tensor]:
    items = result if isinstance(result, (tuple, list)) else (result,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _run(fn, kwargs, grads, dtype, cotangent_seed: int, device: str = "cpu", frozen=()):
    """Outputs and input gradients, returned on the CPU."""
    call, leaves = _call_args(kwargs, grads, dtype, device, frozen)
    outs = _outputs(fn(**call))
    if grads:
        gen = torch.Generator().manual_seed(cotangent_seed)
        total = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum() for o in outs)
        total.backward()
    grad_of = {n: None if leaves[n].grad is None else leaves[n].grad.cpu() for n in grads}
    return [o.detach().cpu() for o in outs], grad_of


def _device(which: str) -> str:
    """Kernels run where they were built for: CUDA when present (the interpreter runs on CPU tensors)."""
    return "cuda" if which == "kernel" and torch.cuda.is_available() else "cpu"


def selection_check(fn, kwargs, device: str) -> float:
    """Fraction of selected keys that are admissible: scored (by the fp64 reference) at least as high as the
    k-th best key, within rounding. Tie-aware on purpose: relu makes exact-zero scores common, and which
    of several tied keys a top-k keeps is implementation-defined."""
    from reference_ops.dsa import indexer_scores

    call, _ = _call_args(kwargs, [], None, device)
    ours = fn(**call).cpu()
    ref_args = _call_args(kwargs, [], torch.float64)[0]
    scores = indexer_scores(ref_args["q_BTHK"], ref_args["k_BTK"], ref_args["weights_BTH"], ref_args["scale"])
    k = ours.shape[-1]
    kth = scores.topk(k, dim=-1).values[..., -1:]
    slack = 1e-2 * scores.masked_fill(scores.isinf(), 0).abs().amax(dim=-1, keepdim=True)
    chosen = scores.gather(-1, ours.clamp(min=0))
    admissible = (ours >= 0) & (chosen > float("-inf")) & (chosen >= kth - slack)
    # query t sees t + 1 keys (causal), so it must select min(k, t + 1) of them
    expected = (torch.arange(scores.shape[1]) + 1).clamp(max=k).sum() * scores.shape[0]
    return float(admissible.sum()) / float(expected)


def kernel_runnable() -> bool:
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _dtypes_for(which: str) -> tuple[torch.dtype, ...]:
    # Triton's CPU interpreter computes tl.dot on bf16 operands wrongly (triton 3.9): kernels are
    # checked in fp32 there and in bf16 on CUDA only.
    if which == "kernel" and not torch.cuda.is_available():
        return (torch.float32,)
    return DTYPES


def check_op(op: str, part: SpecPart, hidden: int, T: int, which: str) -> list[Check]:
    """The checks of one run of the op at a spec part's widths."""
    return run_checks(op, which, lambda seed, dtype: build_case(op, part, hidden, T, seed, dtype), op)


def run_checks(op: str, which: str, make, label: str) -> list[Check]:
    """The checks of one run of the op on the cases `make(seed, dtype)` draws, its implementation picked by its backend
    selector, forced to BACKEND_OF[which] for the whole run (so that a kernel's Gluon twins follow the same choice);
    check names start with `label`."""
    with force(BACKEND_OF[which]):
        return _checks_of(op, make, which, dispatch.op(op, torch.device(_device(which))), label)


def _checks_of(op: str, make, which: str, fn, label: str) -> list[Check]:
    ref = OPS[op].resolve("reference")
    checks = []
    if _dtypes_for(which) != DTYPES:
        checks.append(Check(tier=0, name=f"{label}/{which}/bfloat16", metric="-", value=0.0, tolerance=0.0, verdict="skip",
                            op=op, detail="Triton interpreter: bf16 dots are unreliable on CPU; bf16 kernels run on CUDA"))
    for dtype in _dtypes_for(which):
        for seed in SEEDS:
            case = make(seed, dtype)
            name = f"{label}/{which}/{str(dtype).removeprefix('torch.')}/seed{seed}"
            if op in SELECTION_OPS:
                overlap = selection_check(fn, case.kwargs, _device(which))
                checks.append(Check(tier=0, name=name, metric="selection_overlap", value=overlap, tolerance=0.99,
                                    verdict="pass" if overlap >= 0.99 else "fail", op=op))
                continue
            checks += _numeric_checks(op, fn, ref, case, dtype, seed, name, _device(which))
    return checks


def _numeric_checks(op, fn, ref, case, dtype, seed, name, device: str) -> list[Check]:
    # a cotangent stream apart from the inputs': equal to x, it would be orthogonal to a norm's Jacobian
    cotangent_seed = seed + COTANGENT_SEED_OFFSET
    ours, our_grads = _run(fn, case.kwargs, case.grads, None, cotangent_seed, device, case.frozen)
    truth, true_grads = _run(ref, case.kwargs, case.grads, torch.float64, cotangent_seed, frozen=case.frozen)
    tf32 = device == "cuda"  # fp32 kernels on CUDA multiply in TF32: runtime/tolerances.py
    checks = []
    for i, (a, e) in enumerate(zip(ours, truth)):
        checks.append(Check.from_comparison(0, f"{name}/out{i}", compare(a, e, tolerance_for(op, dtype, "out", tf32)), op=op))
    for n in case.grads:
        tol = tolerance_for(op, dtype, "grad", tf32)
        if our_grads[n] is None or true_grads[n] is None:
            checks.append(Check(tier=0, name=f"{name}/grad:{n}", metric="rel_rms", value=float("inf"), tolerance=tol.rel_rms,
                                verdict="fail", op=op, detail="gradient missing"))
            continue
        checks.append(Check.from_comparison(0, f"{name}/grad:{n}", compare(our_grads[n], true_grads[n], tol), op=op))
    return checks


def distinct_ops(spec: ModelSpec) -> list[tuple[str, SpecPart]]:
    """Every (op, spec part) the spec uses, once each (equal parts are one), in layer order."""
    seen, out = set(), []
    for layer in spec.layers:
        for op, part in [("rms_norm", spec.norm)] + ops_for_layer(layer.attention, layer.ffn, spec.stored_format,
                                                                   spec.attn_res):
            key = (op, part.model_dump_json())  # a part holding a dict (rope scaling) has no hash
            if key not in seen:
                seen.add(key)
                out.append((op, part))
    return out


def tier0(spec: ModelSpec, T: int = 33, progress: Progress | None = None, weight_map: dict | None = None,
          source: Path | None = None) -> list[Check]:
    """Checks for every (op, distinct parameters) the spec uses: the torch form, and the kernel where one exists. The
    ops that decode stored weights run on the release's own codes and scales at each stored weight's widths when its
    weight map and folder are given (onboard/align/tiers/stored_cases.py, each check naming the scales it read), on
    codes encoded in the release's format at the model's width otherwise (cases.py)."""
    progress = progress or Progress()
    stored = stored_cases(spec, weight_map, source, T) if weight_map is not None and source is not None else []
    on_release = {case.op for case in stored}
    ops = [(op, part) for op, part in distinct_ops(spec) if not (isinstance(part, StoredWeights) and op in on_release)]
    progress.plan(len(ops) + len(stored))
    checks = []
    for op, part in ops:
        progress.group(op)
        checks += check_op(op, part, spec.hidden_size, T, "torch_form")
        if OPS[op].kernel and OPS[op].resolve("kernel") is not None:
            checks += _kernel_checks(op, lambda which, op=op, part=part: check_op(op, part, spec.hidden_size, T, which))
    for case in stored:
        progress.group(f"{case.op} on {case.label}")
        checks += with_scales(_stored_checks(case), case.scales)
    return checks


def _stored_checks(case) -> list[Check]:
    label = f"{case.op}:{case.label}"
    found = run_checks(case.op, "torch_form", case.make, label)
    if OPS[case.op].kernel and OPS[case.op].resolve("kernel") is not None:
        found += _kernel_checks(case.op, lambda which: run_checks(case.op, which, case.make, label), label)
    return found


def _kernel_checks(op: str, run, label: str | None = None) -> list[Check]:
    """run(which): the op's checks through that path."""
    if kernel_runnable():
        return run("kernel")
    return [Check(tier=0, name=f"{label or op}/kernel", metric="-", value=0.0, tolerance=0.0, verdict="skip",
                  op=op, detail="no CUDA here and TRITON_INTERPRET is not set")]
