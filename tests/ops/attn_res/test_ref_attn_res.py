"""Block attention residuals' mix: the torch form (runtime/ops/attn_res/torch_form.py) vs the fp64 reference, forward
and every gradient (each source, the query, the norm weight), odd sizes; the reference vs the formula as the
Attention Residuals paper and Kimi K3's modeling code state it.

Shape legend: N sources, B batch, T tokens, D model width.
"""
import pytest
import torch

from reference_ops import attn_res as ref
from runtime.ops.attn_res import torch_form as run
from runtime.tolerances import assert_close

D = 40


def _inputs(num_sources: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    # sources of unequal scale (block sums grow with depth), a query that separates them
    return {**{f"s{n}": torch.randn(2, 63, D, generator=g) * (1 + n) for n in range(num_sources)},
            "query_D": torch.randn(D, generator=g) * D ** -0.5, "norm_weight_D": 1 + 0.1 * torch.randn(D, generator=g)}


def _call(fn, leaves: dict, num_sources: int):
    return fn(tuple(leaves[f"s{n}"] for n in range(num_sources)), leaves["query_D"], leaves["norm_weight_D"], 1e-6)


@pytest.mark.parametrize("num_sources", [1, 2, 5], ids=["N1-embedding-only", "N2", "N5"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_torch_form_matches_reference(num_sources, dtype):
    inputs = _inputs(num_sources, seed=num_sources)
    run_in = {n: t.to(dtype).requires_grad_() for n, t in inputs.items()}
    ref_in = {n: t.detach().double().requires_grad_() for n, t in run_in.items()}
    out_run, out_ref = _call(run.attn_res_mix, run_in, num_sources), _call(ref.attn_res_mix, ref_in, num_sources)
    assert out_run.dtype == dtype
    assert_close(out_run, out_ref, "attn_res_mix", dtype, "out")
    cot = torch.randn_like(out_ref)
    out_run.backward(cot.to(dtype))
    out_ref.backward(cot)
    for name in inputs:
        assert_close(run_in[name].grad, ref_in[name].grad, "attn_res_mix", dtype, "grad", name)


def test_reference_is_the_papers_block_attn_res():
    """stack the sources, RMSNorm them for the keys, logits = w . K, softmax over depth, weighted sum of the raw
    sources (the paper's block_attn_res; Kimi K3's attn_res_mix)."""
    inputs = {n: t.double() for n, t in _inputs(3, seed=9).items()}
    values = torch.stack([inputs[f"s{n}"] for n in range(3)])
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + 1e-6) * inputs["norm_weight_D"]
    logits = torch.einsum("d,nbtd->nbt", inputs["query_D"], keys)
    expected = torch.einsum("nbt,nbtd->btd", logits.softmax(0), values)
    torch.testing.assert_close(_call(ref.attn_res_mix, inputs, 3), expected, rtol=1e-12, atol=1e-12)
    # one source: the mix is that source
    torch.testing.assert_close(_call(ref.attn_res_mix, inputs, 1), inputs["s0"], rtol=0, atol=0)
