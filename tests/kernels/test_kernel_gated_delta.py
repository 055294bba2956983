"""GDN and KDA Triton kernels (runtime/kernels/gated_delta) under TRITON_INTERPRET=1 vs the fp64
references: forward and the gradients of q, k, v, g, beta and the initial state, tiny shapes, fp32
inputs (the interpreter's tl.dot is wrong on bf16 operands). Every kernel-written buffer is NaN-filled
first, so a value a kernel forgets to write fails the comparison. Each KernelVariant under measurement
runs here too; variants that store intermediates in bf16 are held to the bf16 tolerance (fp32 inputs,
so the error measured is the storage's alone).

Shape legend: B batch, T tokens, H heads, K key dim, V value dim, N packed sequences.
"""
import os
from dataclasses import replace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import runtime.kernels.gated_delta as kernels  # noqa: E402
import runtime.kernels.gated_delta.function as kernel_config  # noqa: E402
from reference_ops.gated_delta import gated_delta_rule as ref_gdn  # noqa: E402
from reference_ops.kda import kda as ref_kda  # noqa: E402
from runtime.kernels.gated_delta.function import FP32_TILES, KernelVariant  # noqa: E402
from runtime.tolerances import assert_close  # noqa: E402

pytestmark = pytest.mark.interpreter
OPS = {"gdn": ("gated_delta_rule", ref_gdn, kernels.gated_delta_rule), "kda": ("kda", ref_kda, kernels.kda)}
NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
# The default's scans run V=32 in value blocks of 32; "bv16" runs two programs per head.
VARIANTS = {
    "default": KernelVariant(),
    "bv16": KernelVariant(scan_value_block=16),
    "fp32_tiles": FP32_TILES,
    "fp32_tiles_split_diagonal": replace(FP32_TILES, split_diagonal=True),
    "fp32_tiles_keep_forward": replace(FP32_TILES, keep_forward=True),
    "in_chunk_diagonal": KernelVariant(split_diagonal=False),
    # the forward measured before prep_blocked_kernel (prep_kernel, diag_kernel's inverse, tf32 products)
    # prep_kernel (whole [C, K] tiles) with the doubling inverse
    "unblocked_prep": KernelVariant(blocked_prep=False),
    # prep in two launches (Gram products and Tinv, then the column outputs) on the scalar decay's default
    "gdn_split_prep": KernelVariant(bf16_grad_dots=True, split_prep=True),
    "forward_before": KernelVariant(blocked_prep=False, doubling_inverse=False, bf16_dots=False, fp32_u=False,
                                    output_value_block=16, forward_scan_warps=8),
}


def nan_empty(*shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.fixture(autouse=True)
def small_chunks_nan_buffers(monkeypatch):
    """Chunk 32 in sub-chunks of 16: exercises both the in-block and the cross-block paths at T=63."""
    monkeypatch.setattr(kernel_config, "CHUNK_SIZE", 32)
    monkeypatch.setattr(kernel_config, "SUB_CHUNK", 16)
    monkeypatch.setattr(kernel_config, "empty", nan_empty)


def make_inputs(kind, B=1, T=63, H=2, K=16, V=16, num_states=None, decay=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen)
    g_shape = (B, T, H, K) if kind == "kda" else (B, T, H)
    return {
        "q": rand(B, T, H, K), "k": rand(B, T, H, K), "v": rand(B, T, H, V),
        "g": decay * F.logsigmoid(rand(*g_shape) + 1.0), "beta": torch.sigmoid(rand(B, T, H)),
        "h0": rand(num_states or B, H, K, V),
    }


def outputs_and_grads(fn, x, dtype, **kw):
    """[o, final_state, dq, dk, dv, dg, dbeta, dh0] with fixed random cotangents."""
    leaves = {n: t.to(dtype).detach().requires_grad_() for n, t in x.items()}
    o, s = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state_BHKV=leaves["h0"], **kw)
    gen = torch.Generator().manual_seed(7)
    loss = (o * torch.randn(o.shape, generator=gen).to(o.dtype)).sum()
    loss = loss + (s * torch.randn(s.shape, generator=gen).to(s.dtype)).sum()
    loss.backward()
    return [o, s] + [leaves[n].grad for n in ("q", "k", "v", "g", "beta", "h0")]


def check(kind, x, dtype=torch.float32, variant="default", **kw):
    op, ref, kernel = OPS[kind]
    chosen = VARIANTS[variant]
    # the reference sees the same (dtype-rounded) inputs as the kernel, as in bench/bench_gated_delta.py:
    # the bar bounds the kernel's error, not the rounding of its inputs
    expected = outputs_and_grads(ref, {n: t.to(dtype) for n, t in x.items()}, torch.float64, **kw)
    actual = outputs_and_grads(kernel, x, dtype, variant=chosen, **kw)
    # intermediates stored in bf16 round like bf16 inputs would
    bar = torch.bfloat16 if chosen.bf16_tiles or chosen.bf16_states else dtype
    for name, a, e in zip(NAMES, actual, expected):
        assert_close(a, e, op, bar, kind="out" if name in ("o", "final_state") else "grad", name=name)


def value_dim(variant):
    return 16 if VARIANTS[variant].scan_value_block is None else 32


def cases(kinds, variants, fast=()):
    """(kind, variant) params; all slow except the pairs in fast."""
    return [pytest.param(k, v, id=f"{k}-{v}", marks=() if (k, v) in fast else pytest.mark.slow)
            for k in kinds for v in variants]


FAST = [("gdn", "default"), ("gdn", "fp32_tiles"), ("gdn", "bv16"), ("kda", "default")]


# keep_forward changes no kernel, only what the backward reuses, so GDN alone runs it with fp32 tiles
T63_CASES = (cases(["gdn", "kda"], ["default", "bv16", "fp32_tiles", "fp32_tiles_split_diagonal",
                                    "in_chunk_diagonal", "unblocked_prep", "forward_before"], FAST)
             + cases(["gdn"], ["fp32_tiles_keep_forward", "gdn_split_prep"], FAST))


@pytest.mark.parametrize("kind,variant", T63_CASES)
def test_kernel_T63_initial_state(kind, variant):
    check(kind, make_inputs(kind, V=value_dim(variant)), variant=variant)


@pytest.mark.parametrize("kind,variant", cases(["gdn", "kda"], ["default", "fp32_tiles"], [("kda", "default")])
                         + cases(["gdn"], ["gdn_split_prep"], [("gdn", "gdn_split_prep")]))
def test_kernel_cu_seqlens(kind, variant):
    """Three packed sequences (one shorter than a sub-chunk, one spanning two chunks), one state each."""
    x = make_inputs(kind, T=63, V=value_dim(variant), num_states=3)
    check(kind, x, variant=variant, cu_seqlens=torch.tensor([0, 5, 40, 63]))


# Strong decays test the exact per-channel diagonal blocks, which split_diagonal moves (KDA only)
@pytest.mark.parametrize("kind,variant", cases(["gdn", "kda"], ["default", "fp32_tiles"])
                         + cases(["gdn"], ["gdn_split_prep"], [("gdn", "gdn_split_prep")]))
def test_kernel_batch2_no_l2norm_strong_decay(kind, variant):
    """B=2 folded into time; no qk l2norm, an explicit scale, decays up to ~-15 per token."""
    x = make_inputs(kind, B=2, T=40, decay=15.0)
    check(kind, x, variant=variant, use_qk_l2norm=False, scale=0.3)


@pytest.mark.slow
def test_kernel_bf16_inputs_kda():
    """bf16 loads and stores (the kernel computes in fp32) against the fp64 reference at the bf16 tolerance."""
    check("kda", make_inputs("kda"), dtype=torch.bfloat16)


def test_variant_names_resolve_to_the_default_path():
    """"base" is KernelVariant(); "default" and None mean the measured fastest settings of the decay kind,
    with fp32 intermediates for fp32 inputs."""
    assert kernels.VARIANTS["base"] == KernelVariant()
    assert kernels._resolve("default") is None
    assert kernel_config.default_variant(False, torch.bfloat16) == kernel_config.SCALAR_DECAY_DEFAULT
    assert kernel_config.default_variant(True, torch.bfloat16) == kernel_config.PER_CHANNEL_DECAY_DEFAULT
    fp32 = kernel_config.default_variant(True, torch.float32)
    assert not (fp32.bf16_tiles or fp32.bf16_states or fp32.bf16_grad_dots)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_runtime_default_fp32_inputs_keep_fp32_precision(kind):
    """variant=None with fp32 inputs (what the runtime and tier 0 run): the measured default settings with fp32
    intermediates, held to the fp32 tolerance against the fp64 reference, forward and backward."""
    op, ref, kernel = OPS[kind]
    x = make_inputs(kind, V=32, num_states=None)
    expected = outputs_and_grads(ref, x, torch.float64)
    actual = outputs_and_grads(kernel, x, torch.float32)
    for name, a, e in zip(NAMES, actual, expected):
        assert_close(a, e, op, torch.float32, kind="out" if name in ("o", "final_state") else "grad", name=name)


def test_keep_forward_without_grad_gdn():
    """Under no_grad keep_forward stores nothing for a backward; the output is still the reference's."""
    x = make_inputs("gdn")
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    with torch.no_grad():
        o, state = kernels.gated_delta_rule(*args, initial_state_BHKV=x["h0"], variant="default")
    o_ref, state_ref = ref_gdn(*args, initial_state_BHKV=x["h0"])
    # fp32 inputs: the default keeps fp32 intermediates, so the fp32 bar
    assert_close(o, o_ref, "gated_delta_rule", torch.float32, name="o")
    assert_close(state, state_ref, "gated_delta_rule", torch.float32, name="final_state")


@pytest.mark.parametrize("used", ["o", "final_state"])
def test_one_output_unused_gdn(used):
    """A loss of o alone (the final state's gradient arrives as None: no dht read) or of the final state alone
    (o's gradient None, taken as zeros): the gradients still match the reference's."""
    x = make_inputs("gdn")
    grads = []
    for fn, dtype in ((ref_gdn, torch.float64), (kernels.gated_delta_rule, torch.float32)):
        leaves = {n: t.to(dtype).detach().requires_grad_() for n, t in x.items()}
        o, s = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state_BHKV=leaves["h0"])
        out = o if used == "o" else s
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(dtype)).sum().backward()
        grads.append([leaves[n].grad for n in ("q", "k", "v", "g", "beta", "h0")])
    for name, e, a in zip(NAMES[2:], *grads):
        if e is None:
            # no path from the input to the loss (q to the final state): the kernel's gradient is exactly zero
            assert a is None or torch.equal(a, torch.zeros_like(a)), name
        else:
            assert_close(a, e, "gated_delta_rule", torch.float32, kind="grad", name=name)


def test_batched_layout_cache_is_per_chunk_size(monkeypatch):
    """The layout cached per shape is also per chunk size: B=2 at chunk 64 after the same shape at chunk 32 (the
    fixture's) must not reuse chunk 32's layout, forward and backward."""
    x = make_inputs("gdn", B=2, T=40)
    check("gdn", x)
    monkeypatch.setattr(kernel_config, "CHUNK_SIZE", 64)
    layout = kernel_config._batched_layout(2, 40, 64, torch.device("cpu"))
    assert layout.num_chunks == 2 and layout.chunk_end.tolist() == [40, 80]
    check("gdn", x)
