"""The GDN/KDA backward kernels with two key blocks (backward.KEY_BLOCK 8 at K=16), so the per-K-block
partials of state_grad_kernel and wy_grad_kernel are summed as at the benchmark shape (K=128 in blocks
of 64); the interpreter, fp32 inputs and NaN-filled buffers as in tests/test_kernel_gated_delta.py.
"""
import os
from dataclasses import replace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import runtime.kernels.gated_delta.backward as backward_kernels  # noqa: E402
import runtime.kernels.gated_delta.function as kernel_config  # noqa: E402
from tests.kernels.test_kernel_gated_delta import check, make_inputs, small_chunks_nan_buffers  # noqa: E402, F401

pytestmark = pytest.mark.interpreter


@pytest.fixture(autouse=True)
def two_key_blocks(monkeypatch):
    monkeypatch.setattr(backward_kernels, "KEY_BLOCK", 8)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("variant", ["fp32_tiles", "default"])
def test_backward_two_key_blocks_cu_seqlens(kind, variant):
    """Three packed sequences with initial states; fp32 tiles hold the fp32 tolerance."""
    x = make_inputs(kind, T=63, V=32 if variant == "default" else 16, num_states=3)
    check(kind, x, variant=variant, cu_seqlens=torch.tensor([0, 5, 40, 63]))


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_backward_two_key_blocks_strong_decay(kind):
    """B=2, no qk l2norm, decays up to ~-15 per token."""
    check(kind, make_inputs(kind, B=2, T=40, decay=15.0), variant="fp32_tiles", use_qk_l2norm=False, scale=0.3)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_backward_benchmark_chunk_size(kind, monkeypatch):
    """The benchmark's chunk of 64 (sub-chunks of 16) over two sequences, K=32 in key blocks of 16."""
    monkeypatch.setattr(kernel_config, "CHUNK_SIZE", 64)
    monkeypatch.setattr(backward_kernels, "KEY_BLOCK", 16)
    x = make_inputs(kind, T=150, K=32, V=32, num_states=2)
    check(kind, x, variant="default", cu_seqlens=torch.tensor([0, 70, 150]))


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_backward_bf16_grad_dots(kind, monkeypatch):
    """KernelVariant.bf16_grad_dots (bf16 operands in the gradient kernels, dw's scratch in bf16), with
    three packed sequences and initial states, and B=2 strong decay without the qk l2norm."""
    from tests.kernels.test_kernel_gated_delta import VARIANTS
    monkeypatch.setitem(VARIANTS, "bf16_grads", kernel_config.KernelVariant(bf16_grad_dots=True))
    check(kind, make_inputs(kind, T=63, V=32, num_states=3), variant="bf16_grads",
          cu_seqlens=torch.tensor([0, 5, 40, 63]))
    check(kind, make_inputs(kind, B=2, T=40, V=32, decay=15.0), variant="bf16_grads", use_qk_l2norm=False, scale=0.3)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_backward_state_key_block_apart(kind, monkeypatch):
    """backward.STATE_KEY_BLOCK: GDN's state_grad_kernel in four key blocks, wy_grad_kernel in two (KDA
    ignores it)."""
    monkeypatch.setattr(backward_kernels, "STATE_KEY_BLOCK", 4)
    check(kind, make_inputs(kind, T=63, V=32, num_states=3), variant="default", cu_seqlens=torch.tensor([0, 5, 40, 63]))


def test_backward_gram_apart_two_key_blocks(monkeypatch):
    """KDA with KernelVariant.gram_grad_apart (on the KDA default): state_grad_kernel stores gc per key block and
    wy_grad_kernel reads it per key block of 8, gram_grad_kernel on the whole K. Three packed sequences with
    initial states and state_grad in key blocks of 4 (state_grad_key_block), then B=2 strong decay without the
    qk l2norm."""
    from tests.kernels.test_kernel_gated_delta import VARIANTS
    gram_apart = kernel_config.KernelVariant(token_parallel_diag=True, blocked_prep=False, gram_grad_apart=True)
    monkeypatch.setitem(VARIANTS, "gram_apart", gram_apart)
    monkeypatch.setitem(VARIANTS, "gram_apart_skb4", replace(gram_apart, state_grad_key_block=4))
    check("kda", make_inputs("kda", T=63, V=32, num_states=3), variant="gram_apart_skb4",
          cu_seqlens=torch.tensor([0, 5, 40, 63]))
    check("kda", make_inputs("kda", B=2, T=40, V=32, decay=15.0), variant="gram_apart", use_qk_l2norm=False,
          scale=0.3)


def test_backward_stored_norms_fused_finish_gdn(monkeypatch):
    """GDN with KernelVariant.stored_norms and fused_finish (wy_grad_kernel finishes dq, dk, dg on prep's inverse
    norms): three packed sequences with initial states, then B=2 strong decay without the qk l2norm (nothing
    stored, wy_grad's tail without the l2norm)."""
    from tests.kernels.test_kernel_gated_delta import VARIANTS
    monkeypatch.setitem(VARIANTS, "norms_finish", kernel_config.KernelVariant(bf16_grad_dots=True, stored_norms=True,
                                                                              fused_finish=True))
    check("gdn", make_inputs("gdn", T=63, V=32, num_states=3), variant="norms_finish",
          cu_seqlens=torch.tensor([0, 5, 40, 63]))
    check("gdn", make_inputs("gdn", B=2, T=40, V=32, decay=15.0), variant="norms_finish", use_qk_l2norm=False,
          scale=0.3)


@pytest.mark.slow
def test_backward_fused_finish_recomputed_norms_gdn(monkeypatch):
    """fused_finish alone: wy_grad's tail recomputes q's norms from the tile (k's from its own loop)."""
    from tests.kernels.test_kernel_gated_delta import VARIANTS
    monkeypatch.setitem(VARIANTS, "fused_finish", kernel_config.KernelVariant(fused_finish=True))
    check("gdn", make_inputs("gdn", T=63, V=32, num_states=3), variant="fused_finish",
          cu_seqlens=torch.tensor([0, 5, 40, 63]))


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_backward_stored_norms_recompute(kind, monkeypatch):
    """stored_norms with keep_forward off: the backward's prep stores the norms again; GDN's finish_kernel and
    KDA's diag_grad_kernel (the column-walking diagonal) read them."""
    from tests.kernels.test_kernel_gated_delta import VARIANTS
    monkeypatch.setitem(VARIANTS, "recompute_norms", kernel_config.KernelVariant(keep_forward=False, stored_norms=True))
    check(kind, make_inputs(kind, T=63, V=32, num_states=3), variant="recompute_norms",
          cu_seqlens=torch.tensor([0, 5, 40, 63]))
