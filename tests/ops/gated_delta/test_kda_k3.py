"""Kimi K3's KDA: the lower-bounded decay (gate_lower_bound) torch form vs its fp64 twin, forward and gradients;
and the runtime layer with K3's full-rank output gate, flat zero-padded A_log and bounded decay vs Kimi K3's KDA
written out (short conv + silu, L2-normed q/k, the delta rule token by token, RMSNorm times sigmoid(g_proj(x))).

Shape legend: B batch, T tokens, D model width, H heads, K head width.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from reference_ops import kda as ref
from runtime.model.layers.linear_attention import KimiDeltaAttention
from runtime.ops.gated_delta import kda_torch_form as run
from runtime.spec import KDAAttention
from runtime.tolerances import assert_close


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["kimi-linear-softplus", "k3-bounded"])
def test_log_decay_matches_reference(lower_bound):
    g = torch.Generator().manual_seed(1)
    gate_in = (torch.randn(2, 63, 3, 5, generator=g) * 3).requires_grad_()
    A_log = (torch.randn(3, generator=g) * 0.5).requires_grad_()
    ours = run.kda_log_decay(gate_in, A_log, lower_bound)
    gate_ref, A_ref = gate_in.detach().double().requires_grad_(), A_log.detach().double().requires_grad_()
    theirs = ref.kda_log_decay(gate_ref, A_ref, lower_bound)
    assert_close(ours, theirs, "kda", torch.float32, "out", "log decay")
    cot = torch.randn_like(theirs)
    ours.backward(cot.float())
    theirs.backward(cot)
    assert_close(gate_in.grad, gate_ref.grad, "kda", torch.float32, "grad", "gate_in")
    assert_close(A_log.grad, A_ref.grad, "kda", torch.float32, "grad", "A_log")
    if lower_bound is not None:
        assert bool(((theirs > lower_bound) & (theirs < 0)).all())


def _released_kda(layer: KimiDeltaAttention, x, eps: float, lower_bound: float):
    """Kimi K3's KDA forward as its modeling code states it, in fp64, on the layer's weights."""
    B, T, _ = x.shape
    H, K = layer.H, layer.K
    w = {n: p.detach().double() for n, p in layer.named_parameters()}
    x = x.double()

    def conv(t, weight):  # causal depthwise conv over time, then silu
        return F.silu(F.conv1d(F.pad(t.transpose(1, 2), (weight.shape[-1] - 1, 0)), weight, groups=t.shape[-1])
                      ).transpose(1, 2)

    heads = lambda t: t.reshape(B, T, H, K)  # noqa: E731
    q = F.normalize(heads(conv(x @ w["q_proj.weight"].T, w["q_conv1d.weight"])), dim=-1)
    k = F.normalize(heads(conv(x @ w["k_proj.weight"].T, w["k_conv1d.weight"])), dim=-1)
    v = heads(conv(x @ w["v_proj.weight"].T, w["v_conv1d.weight"]))
    raw = heads(x @ w["f_a_proj.weight"].T @ w["f_b_proj.weight"].T) + w["dt_bias"].view(H, K)
    log_gate = lower_bound * torch.sigmoid(w["A_log"][:H].exp()[:, None] * raw)
    beta = torch.sigmoid(x @ w["b_proj.weight"].T)
    state, outs = torch.zeros(B, H, K, K, dtype=torch.float64), []
    for t in range(T):
        state = state * log_gate[:, t].exp()[..., None]
        delta = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state)) * beta[:, t, :, None]
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * K ** -0.5, state))
    o = torch.stack(outs, dim=1)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * w["o_norm.weight"]
    o = o * torch.sigmoid(heads(x @ w["g_proj.weight"].T))
    return o.reshape(B, T, H * K) @ w["o_proj.weight"].T


def test_k3_layer_matches_the_released_kda():
    H, K, D, eps = 3, 16, 40, 1e-6
    spec = KDAAttention(num_heads=H, head_dim=K, conv_kernel_size=4, full_rank_gate=True, gate_lower_bound=-5.0,
                        a_log_width=K)
    layer = KimiDeltaAttention(spec, D, eps)
    assert not hasattr(layer, "g_a_proj") and tuple(layer.A_log.shape) == (K,)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if "norm" in name else 0.0))
        layer.A_log[H:] = 0.0  # the padding, as released
    x = torch.randn(2, 37, D)
    ours = layer(x)
    assert_close(ours, _released_kda(layer, x, eps, -5.0), "kda", torch.float32, "out", "K3 KDA layer")
    ours.square().sum().backward()
    assert layer.g_proj.weight.grad.abs().sum() > 0 and layer.A_log.grad[:H].abs().sum() > 0
    assert layer.A_log.grad[H:].abs().sum() == 0
