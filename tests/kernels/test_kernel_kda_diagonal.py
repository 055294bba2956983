"""KDA with the token-parallel diagonal kernels (KernelVariant.token_parallel_diag: diagonal.diag_token_kernel,
diag_grad_token_kernel, dg_finish_kernel), with the per-channel Gram backward apart (gram_grad_apart) and prep
in two launches (split_prep: the per-channel default), against the fp64 reference, as
tests/test_kernel_gated_delta.py checks the other variants: the interpreter, fp32 inputs (bf16 once),
NaN-filled buffers, chunk 32 in sub-chunks of 16 (chunk 64 once), H=2 (one program per head pair at
TOKEN_DIAG_HEADS 4: BH 2) and H=3 (BH 1).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import runtime.kernels.gated_delta.function as kernel_config  # noqa: E402
import tests.kernels.test_kernel_gated_delta as shared  # noqa: E402
from runtime.kernels.gated_delta.function import KernelVariant  # noqa: E402
from tests.kernels.test_kernel_gated_delta import check, make_inputs, small_chunks_nan_buffers  # noqa: E402, F401

pytestmark = pytest.mark.interpreter

TOKEN_VARIANTS = {
    "token_diag": KernelVariant(token_parallel_diag=True),
    "token_diag_unblocked": KernelVariant(token_parallel_diag=True, blocked_prep=False),
    "token_diag_fp32_tiles": KernelVariant(token_parallel_diag=True, bf16_tiles=False, bf16_states=False),
    # the per-channel Gram backward in backward.gram_grad_kernel, on the KDA default, with bf16 wy_grad products
    "gram_apart": KernelVariant(token_parallel_diag=True, blocked_prep=False, gram_grad_apart=True),
    "gram_apart_bf16": KernelVariant(token_parallel_diag=True, blocked_prep=False, gram_grad_apart=True,
                                     bf16_grad_dots=True),
    # prep in two launches after diag_token_kernel (32 columns per column program at these widths)
    "kda_split_prep": KernelVariant(token_parallel_diag=True, split_prep=True),
    # the runtime's per-channel default (function.PER_CHANNEL_DECAY_DEFAULT)
    "kda_default": kernel_config.PER_CHANNEL_DECAY_DEFAULT,
}
# The longer cases run the per-channel default alone: it holds the token-parallel diagonal kernels, prep in
# two launches and gram_grad_apart (each variant above runs them at T=63)
DEFAULT = ["kda_default"]


@pytest.fixture(autouse=True)
def token_variants(monkeypatch):
    """check() looks its variant up in the shared table."""
    monkeypatch.setattr(shared, "VARIANTS", {**shared.VARIANTS, **TOKEN_VARIANTS})


@pytest.mark.parametrize("variant", list(TOKEN_VARIANTS))
def test_kda_token_diag_T63_initial_state(variant):
    check("kda", make_inputs("kda", V=32), variant=variant)


@pytest.mark.parametrize("variant", DEFAULT)
def test_kda_token_diag_cu_seqlens_three_heads(variant):
    """Three packed sequences (one shorter than a sub-chunk, one spanning two chunks), one state each; H=3."""
    x = make_inputs("kda", T=63, H=3, V=32, num_states=3)
    check("kda", x, variant=variant, cu_seqlens=torch.tensor([0, 5, 40, 63]))


# gram_apart's tf32 path runs strong decay in tests/test_kernel_gated_delta_backward.py (two key blocks)
@pytest.mark.parametrize("variant", ["token_diag"] + DEFAULT)
def test_kda_token_diag_batch2_no_l2norm_strong_decay(variant):
    """B=2 folded into time; no qk l2norm, an explicit scale, decays up to ~-15 per token."""
    check("kda", make_inputs("kda", B=2, T=40, V=32, decay=15.0), variant=variant, use_qk_l2norm=False, scale=0.3)


@pytest.mark.parametrize("variant", ["gram_apart", pytest.param("gram_apart_bf16", marks=pytest.mark.slow)])
def test_kda_gram_apart_four_sub_chunks(variant, monkeypatch):
    """gram_grad_kernel's loops over several earlier and later sub-chunks: chunk 32 in sub-chunks of 8 (the
    interpreter's products take any size), three packed sequences, the last chunk of one ending mid-sub-chunk."""
    monkeypatch.setattr(kernel_config, "SUB_CHUNK", 8)
    x = make_inputs("kda", T=50, V=32, num_states=3)
    check("kda", x, variant=variant, cu_seqlens=torch.tensor([0, 3, 45, 50]))


@pytest.mark.slow
def test_kda_token_diag_bf16_inputs():
    check("kda", make_inputs("kda", V=32), dtype=torch.bfloat16, variant="token_diag")


@pytest.mark.slow
@pytest.mark.parametrize("variant", DEFAULT)
def test_kda_token_diag_benchmark_chunk_size(variant, monkeypatch):
    """The benchmark's chunk 64 (four sub-chunks), two packed sequences."""
    monkeypatch.setattr(kernel_config, "CHUNK_SIZE", 64)
    x = make_inputs("kda", T=150, V=32, num_states=2)
    check("kda", x, variant=variant, cu_seqlens=torch.tensor([0, 70, 150]))
