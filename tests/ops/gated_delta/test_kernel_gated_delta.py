"""GDN and KDA Triton kernels (runtime/ops/gated_delta) under TRITON_INTERPRET=1 vs the fp64
references: the forward and the gradients of q, k, v, g, beta and the initial state on tiny shapes,
chunk 32 in sub-chunks of 16, every kernel-written buffer NaN-filled first. fp32 inputs run the fp32
storage path at the fp32 tolerance, bf16 inputs the bf16 one (what the GPU runs) at the bf16 tolerance.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim.
"""
import pytest
import torch

from runtime.ops.gated_delta import function
from runtime.tolerances import assert_close
from tests.ops.gated_delta.gated_delta_cases import (
    CASES, CU_SEQLENS, NAMES, check, check_case, make_inputs, ops,
)

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("small_chunks_nan_buffers")]
KINDS = ["gdn", "kda"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_cases(kind, case):
    check_case(kind, case)


@pytest.mark.parametrize("kind", ["gdn", pytest.param("kda", marks=pytest.mark.slow)])
def test_kernel_bf16_inputs_cu_seqlens(kind):
    """bf16 inputs: bf16 tiles and states, bf16 products in the scans and wy_grad (rounded as on the GPU)."""
    check(kind, make_inputs(kind, num_states=3), dtype=torch.bfloat16, cu_seqlens=torch.tensor(CU_SEQLENS))


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_two_scan_value_blocks(kind, monkeypatch):
    """The scans in value blocks of 16 at V=32: two programs per sequence and head, o's columns at the block's
    offset."""
    monkeypatch.setattr(function, "SCAN_VALUE_BLOCK", 16)
    check(kind, make_inputs(kind, num_states=3), cu_seqlens=torch.tensor(CU_SEQLENS))


@pytest.mark.parametrize("decay", [1.0, 6.0], ids=["decay1", "decay6"])
def test_kda_four_sub_chunks(decay, monkeypatch):
    """The GPU's chunk of 64 in four sub-chunks of 16, T=100 (a full chunk, then one whose last sub-chunk is
    partial): the per-channel decay between sub-chunks that are not neighbours spans the ones between
    (common.decayed_grams), which chunk 32 in two sub-chunks never has."""
    monkeypatch.setattr(function, "CHUNK_SIZE", 64)
    check("kda", make_inputs("kda", T=100, decay=decay))


@pytest.mark.parametrize("K,V", [(32, 16), (16, 32)], ids=["K32-V16", "K16-V32"])
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_prep_column_blocks(kind, K, V):
    """prep over two column blocks of K or of V (min(PREP_BLOCK, K, V) wide; KDA's column outputs
    min(PREP_COLUMN_BLOCK, K, V)), three packed sequences."""
    check(kind, make_inputs(kind, K=K, V=V, num_states=3), cu_seqlens=torch.tensor(CU_SEQLENS))


def test_storage_follows_the_input_dtype():
    """fp32 inputs keep fp32 intermediates (the fp32 tolerance above holds them); others store bf16."""
    assert function.Storage.of(torch.float32) == function.Storage(torch.float32, function.DOT_PRECISION)
    assert function.Storage.of(torch.bfloat16).dtype == torch.bfloat16


def test_scan_stages_follow_the_gpus_shared_memory(monkeypatch):
    """Three stages where a block takes SCAN_STAGES_SHARED_BYTES (Hopper: 227 KB), two on an A100 (164 KB)."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(function, "_shared_bytes_per_block", lambda index: 227 * 1024)
    assert function.scan_stages(cuda) == function.SCAN_STAGES == 3
    monkeypatch.setattr(function, "_shared_bytes_per_block", lambda index: 164 * 1024)
    assert function.scan_stages(cuda) == 2
    assert function.scan_stages(torch.device("cpu")) == function.SCAN_STAGES


@pytest.mark.parametrize("kind", KINDS)
def test_forward_without_grad(kind):
    """Under no_grad prep keeps nothing for a backward (GDN stores no Tinv) and the scan no states: the output is
    still the reference's, and exactly the one a forward with grad gives."""
    op, ref, kernel = ops()[kind]
    x = make_inputs(kind)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    with torch.no_grad():
        o, state = kernel(*args, initial_state_BHKV=x["h0"])
    o_grad, state_grad = kernel(*[a.detach().requires_grad_() for a in args], initial_state_BHKV=x["h0"])
    assert torch.equal(o, o_grad.detach()) and torch.equal(state, state_grad.detach())
    o_ref, state_ref = ref(*[a.double() for a in args], initial_state_BHKV=x["h0"].double())
    assert_close(o, o_ref, op, torch.float32, name="o")
    assert_close(state, state_ref, op, torch.float32, name="final_state")


@pytest.mark.parametrize("used", ["o", "final_state", "final_state-summed"])
def test_one_output_unused_gdn(used):
    """A loss of o alone (the final state's gradient arrives as None: no dht read) or of the final state alone
    (o's gradient None, taken as zeros; summed, the final state's gradient comes expanded, stride 0, and must not be
    read as a packed array): the gradients still match the reference's."""
    x = make_inputs("gdn")
    _, ref, kernel = ops()["gdn"]
    grads = []
    for fn, dtype in ((ref, torch.float64), (kernel, torch.float32)):
        leaves = {n: t.to(dtype).detach().requires_grad_() for n, t in x.items()}
        o, s = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state_BHKV=leaves["h0"])
        out = o if used == "o" else s
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
        (out.sum() if used == "final_state-summed" else (out * weights).sum()).backward()
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
    monkeypatch.setattr(function, "CHUNK_SIZE", 64)
    layout = function._batched_layout(2, 40, 64, torch.device("cpu"))
    assert layout.num_chunks == 2 and layout.chunk_end.tolist() == [40, 80]
    check("gdn", x)
