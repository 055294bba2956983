"""Global gradient-norm clipping (runtime/parallel/grads.py) on one process: the norm over fp32 and bf16 gradients
against an fp64 sum, the scaling torch's clip rule gives, and no scaling up."""
import torch
from torch import nn

from runtime.parallel.grads import clip_grad_norm


def _params(scale: float) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape, dtype in (((33, 7), torch.float32), ((129,), torch.bfloat16), ((5, 5, 3), torch.float32)):
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=gen) * scale).to(dtype)
        params.append(p)
    return params


def test_norm_over_mixed_dtypes_is_the_fp64_norm_and_clips_to_max():
    params = _params(3.0)
    before = [p.grad.double() for p in params]
    expected = torch.cat([g.flatten() for g in before]).norm()
    norm = clip_grad_norm(params, max_norm=1.0)
    # bf16 gradients' norm taken in fp32: a bf16 norm would be off by up to ~4e-3
    assert norm.dtype == torch.float32 and abs(norm.item() - expected.item()) <= 1e-6 * expected.item()
    factor = 1.0 / (expected.item() + 1e-6)
    for p, g in zip(params, before):
        tol = 1e-2 if p.grad.dtype == torch.bfloat16 else 1e-6
        assert torch.allclose(p.grad.double(), g * factor, rtol=tol, atol=0)


def test_small_gradients_are_not_scaled_up():
    params = _params(1e-3)
    before = [p.grad.clone() for p in params]
    clip_grad_norm(params, max_norm=1.0)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, before))
