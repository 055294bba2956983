"""The stored-weight matmul's torch form vs its fp64 twin (reference_ops/stored.py), forward and the gradients of x,
the bias and the LoRA factors, FP8 block-scaled (partial 128-blocks of 576- and 192-row weights, UE8M0 scales) and
MXFP4 (packed rows and gpt-oss's [O, G, 16] blocks); and the rule that the backward decodes the weight again rather
than keeping it.

Shape legend: T tokens, O out width, I in width, r LoRA rank.
"""
import gc
import weakref

import pytest
import torch

from reference_ops import stored as ref
from runtime.ops.stored_matmul import torch_form
from runtime.tolerances import assert_close
from tests.ops.stored_matmul.problems import stored_weight

# (O, I, kind, block, options)
CASES = {
    "fp8-576x64-block128-partial-rows": (576, 64, "fp8_block", (128, 128), {}),
    "fp8-192x200-block128-partial-both": (192, 200, "fp8_block", (128, 128), {}),
    "fp8-96x80-block48x32-ue8m0": (96, 80, "fp8_block", (48, 32), dict(ue8m0=True)),
    "mxfp4-96x64": (96, 64, "mxfp4", None, {}),
    "mxfp4-40x96-gpt-oss-blocks": (40, 96, "mxfp4", None, dict(blocks=True)),
}


def check_stored_linear(fn, O, I, kind, block, *, ue8m0=False, blocks=False, T=63, lora_rank=3, bias=True,
                        dtype=torch.float32, seed=0):
    """fn(x, codes, scale, ...) vs the twin: the output and the gradient of every float leaf."""
    codes, scale = stored_weight((O, I), kind, block, ue8m0, seed)
    if blocks:
        codes = codes.unflatten(-1, (-1, 16))
    gen = torch.Generator().manual_seed(seed + 1)
    leaves = {"x": torch.randn(T, I, generator=gen)}
    if bias:
        leaves["bias_O"] = torch.randn(O, generator=gen)
    if lora_rank:
        leaves |= {"A": torch.randn(lora_rank, I, generator=gen) * 0.3, "B": torch.randn(O, lora_rank, generator=gen) * 0.3}
    # the twin reads the inputs rounded to dtype, so the comparison measures the op
    run = {n: t.to(dtype).requires_grad_() for n, t in leaves.items()}
    truth = {n: t.detach().double().requires_grad_() for n, t in run.items()}
    outs = []
    for impl, args in ((fn, run), (ref.stored_linear, truth)):
        lora = (args["A"], args["B"]) if lora_rank else None
        outs.append(impl(args["x"], codes, scale, kind=kind, block=block, bias_O=args.get("bias_O"), lora=lora,
                         lora_scale=0.5))
    out, expected = outs
    assert out.dtype == dtype and out.shape == (T, O)
    assert_close(out, expected, "stored_linear", dtype, "out")
    cot = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    out.backward(cot.to(dtype))
    expected.backward(cot)
    for name in leaves:
        assert run[name].grad is not None, f"no gradient reached {name}"
        assert_close(run[name].grad, truth[name].grad, "stored_linear", dtype, "grad", name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_form_matches_reference(case, dtype):
    O, I, kind, block, options = CASES[case]
    check_stored_linear(torch_form.stored_linear, O, I, kind, block, dtype=dtype, **options)


def test_leading_dims_and_no_extras():
    codes, scale = stored_weight((48, 64), "mxfp4")
    x = torch.randn(2, 5, 64)
    y = torch_form.stored_linear(x, codes, scale, kind="mxfp4")
    assert y.shape == (2, 5, 48)
    assert_close(y, ref.stored_linear(x, codes, scale, kind="mxfp4"), "stored_linear", torch.float32)


def test_backward_decodes_again_instead_of_keeping_the_weight():
    """saved_as_codes: the graph holds no decoded weight (it is freed after the forward) and the backward decodes it
    again, to the same gradient."""
    codes, scale = stored_weight((64, 96), "fp8_block", (32, 32))
    calls = []

    def redo():
        calls.append(1)
        return torch_form.decode(codes, scale, "fp8_block", (32, 32), torch.float32)

    x = torch.randn(7, 96, requires_grad=True)
    w = redo()
    with torch_form.saved_as_codes([(w, redo)]):
        y = x @ w.T
    kept = weakref.ref(w)
    del w
    gc.collect()
    assert kept() is None
    y.backward(torch.ones_like(y))
    assert len(calls) == 2
    expected = torch.ones(7, 64, dtype=torch.float64) @ ref.decode(codes, scale, "fp8_block", (32, 32))
    assert_close(x.grad, expected, "stored_linear", torch.float32, "grad", "x")


def test_format_kwargs_from_the_stored_format():
    from runtime.formats.scheme import MXFP4, FP8Block

    assert torch_form.format_kwargs(FP8Block(block=(128, 128))) == dict(kind="fp8_block", block=(128, 128))
    assert torch_form.format_kwargs(MXFP4(layout="blocks")) == dict(kind="mxfp4", block=None)
