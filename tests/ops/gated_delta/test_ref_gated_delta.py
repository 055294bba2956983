"""GDN and KDA: the fp64 token-loop references vs transformers (Qwen3-Next, Kimi Linear), and the
chunked torch forms (runtime/ops/gated_delta/torch_form.py, kda.py) vs the references, forward and all gradients.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim.
"""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kda
from transformers.models.qwen3_next import modeling_qwen3_next as hf_gdn

import runtime.ops.gated_delta.torch_form as ops
import runtime.ops.gated_delta.kda_torch_form as ops_kda
from reference_ops.gated_delta import gated_delta_rule as ref_gdn
from reference_ops.kda import kda as ref_kda
from runtime.tolerances import assert_close, compare, tolerance_for

OPS = {"gdn": ("gated_delta_rule", ref_gdn, ops.gated_delta_rule), "kda": ("kda", ref_kda, ops_kda.kda)}


def make_inputs(kind, B=2, T=63, H=3, K=16, V=12, seed=0, decay=1.0, dtype=torch.float64):
    """Inputs as the models make them: g = logsigmoid(.) <= 0, beta = sigmoid(.) in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    g_shape = (B, T, H, K) if kind == "kda" else (B, T, H)
    return {
        "q": rand(B, T, H, K).to(dtype), "k": rand(B, T, H, K).to(dtype), "v": rand(B, T, H, V).to(dtype),
        "g": (decay * F.logsigmoid(rand(*g_shape) + 1.0)).to(dtype),
        "beta": torch.sigmoid(rand(B, T, H)).to(dtype), "h0": rand(B, H, K, V).to(dtype),
    }


def call(fn, x, **kw):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state_BHKV=x.get("h0"), **kw)


@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "no-l2norm"])
def test_reference_matches_transformers_gdn(impl, l2norm):
    x = make_inputs("gdn", H=2, K=16, V=16)
    fn = hf_gdn.torch_recurrent_gated_delta_rule if impl == "recurrent" else hf_gdn.torch_chunk_gated_delta_rule
    fn = getattr(fn, "__wrapped__", fn)
    o_hf, s_hf = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                    output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    o, s = call(ref_gdn, x, use_qk_l2norm=l2norm)
    # transformers computes in fp32 whatever the input dtype: compare at the fp32 tolerance
    assert_close(o_hf, o, "gated_delta_rule", torch.float32, name="o")
    assert_close(s_hf, s, "gated_delta_rule", torch.float32, name="final_state")


@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
def test_reference_matches_transformers_kda(impl):
    x = make_inputs("kda", H=2, K=16, V=16)
    fn = hf_kda.recurrent_kimi_delta_attention if impl == "recurrent" else hf_kda.chunk_kimi_delta_attention
    fn = getattr(fn, "__wrapped__", fn)
    o_hf, s_hf = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = call(ref_kda, x)
    assert_close(o_hf, o, "kda", torch.float32, name="o")
    assert_close(s_hf, s, "kda", torch.float32, name="final_state")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_reference_cu_seqlens_is_separate_sequences(kind):
    _, ref, _ = OPS[kind]
    x = make_inputs(kind, B=1, T=50)
    x["h0"] = torch.cat([x["h0"], 2 * x["h0"]])
    bounds = [0, 21, 50]
    o, s = call(ref, x, cu_seqlens=torch.tensor(bounds))
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        piece = {name: t[:, a:b] for name, t in x.items() if name != "h0"} | {"h0": x["h0"][n : n + 1]}
        o_n, s_n = call(ref, piece)
        assert_close(o[:, a:b], o_n, "ref", name=f"o seq {n}")
        assert_close(s[n : n + 1], s_n, "ref", name=f"state seq {n}")


def grads_of(fn, x, dtype, **kw):
    """[o, final_state, dq, dk, dv, dg, dbeta, dh0] with fixed random cotangents on o and the final state."""
    leaves = {n: t.to(dtype).detach().requires_grad_() for n, t in x.items()}
    o, s = call(fn, leaves, **kw)
    gen = torch.Generator().manual_seed(7)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum()
    loss = loss + (s * torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.dtype)).sum()
    loss.backward()
    return [o, s] + [leaves[n].grad for n in ("q", "k", "v", "g", "beta", "h0")]


CASES = {
    "T63": dict(make=dict(T=63), kw={}),
    "T130-chunk16": dict(make=dict(T=130, B=1), kw={}, chunk=16),
    "T63-no-l2norm-scale0.3": dict(make=dict(T=63), kw=dict(use_qk_l2norm=False, scale=0.3)),
    "strong-decay": dict(make=dict(T=70, decay=30.0), kw={}),
    "cu_seqlens": dict(make=dict(B=1, T=63), kw=dict(cu_seqlens=torch.tensor([0, 5, 40, 63])), h0_seqs=3),
}
NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


def case_inputs(kind, case):
    x = make_inputs(kind, **case["make"])
    if "h0_seqs" in case:
        x["h0"] = torch.randn(case["h0_seqs"], *x["h0"].shape[1:], dtype=torch.float64)
    return x


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_torch_form_matches_reference(kind, case, dtype, monkeypatch):
    op, ref, torch_form = OPS[kind]
    spec = CASES[case]
    monkeypatch.setattr(ops, "CHUNK_SIZE", spec.get("chunk", 64))
    x = case_inputs(kind, spec)
    expected = grads_of(ref, x, torch.float64, **spec["kw"])
    actual = grads_of(torch_form, x, dtype, **spec["kw"])
    for name, a, e in zip(NAMES, actual, expected):
        assert_close(a, e, op, dtype, kind="out" if name in ("o", "final_state") else "grad", name=name)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_chunked_fp64_equals_token_loop_to_1e12(kind):
    """The benchmark takes the chunked fp64 form as its reference at T=8192: it must equal the loop."""
    op, ref, torch_form = OPS[kind]
    x = make_inputs(kind, B=1, T=200, H=2, K=32, V=32)
    for name, a, e in zip(NAMES, grads_of(torch_form, x, torch.float64), grads_of(ref, x, torch.float64)):
        result = compare(a, e, tolerance_for(op, torch.float64))
        assert result.rel_rms < 1e-12, f"{name}: {result.describe()}"
