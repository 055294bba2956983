"""runtime/package_ops.py: a package's generated op of each kind is registered at load and the runtime layer
that the spec names it in calls it: router scoring, norm, rope, gated-delta decay, residual mixing (the
activation slot is exercised end to end in tests/agents/test_onboard.py). Each generated op here computes
a form the runtime also has another way (e.g. 2 x softplus decay = softplus decay with A_log + log 2), so the
layer's output through the slot is checked against the built-in path, not against the op itself. On CUDA the
runtime calls the op through torch.compile; there is no GPU here, so that path is checked by the wrapper it
picks per device type and by compiling a candidate for real on CPU."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from runtime import package_ops, registry
from runtime.spec import ModelSpec, MoEFFN, NormSpec, RopeSpec, RouterSpec, read_spec
from runtime.layers.ffn import Router
from runtime.layers.linear_attention import GatedDeltaNet
from runtime.layers.norm import GeneratedNorm, make_norm
from runtime.model import DecoderLayer
from runtime.ops.moe import route
from runtime.ops.rope import rope_cos_sin, rope_inv_freq
from runtime.rotary import RotaryCache, cos_sin

HEADER = "import math\nimport torch\nimport torch.nn.functional as F\nKIND = {kind!r}\nNAME = {name!r}\n\n"


@pytest.fixture
def load(tmp_path):
    """Writes one generated op into a package's ops/ and loads it; the runtime's tables are restored after."""
    saved = {kind: dict(table) for kind, table in package_ops.TABLES.items()}

    def write_and_load(kind: str, name: str, body: str) -> None:
        (tmp_path / "ops").mkdir(exist_ok=True)
        (tmp_path / "ops" / f"{kind}_{name}.py").write_text(HEADER.format(kind=kind, name=name) + body)
        assert f"{kind}:{name}" in package_ops.load_package_ops(tmp_path)

    yield write_and_load
    for kind, table in package_ops.TABLES.items():
        table.clear()
        table.update(saved[kind])


def _randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


def test_a_generated_router_scoring_is_what_the_router_scores_with(load):
    load("router_scoring", "sqrtsoftplus", "def op(logits_TE):\n    return F.softplus(logits_TE).sqrt()\n")
    moe = MoEFFN(num_experts=8, top_k=2, expert_intermediate_size=4,
                 router=RouterSpec(scoring="sqrtsoftplus", norm_topk_prob=True))
    assert registry.OPS["moe_router"].supports(moe) == "variant"
    router = _randomize(Router(moe, 16))
    x_TD = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    weights_Tk, idx_Tk = router(x_TD)
    # softplus(l)^0.5 is monotonic in l: the same experts as softmax picks, weighted by the new scores
    logits_TE = x_TD @ router.weight.T
    _, expected_idx = route(logits_TE, 2, scoring="softmax", norm_topk_prob=True)
    picked = F.softplus(logits_TE).sqrt().gather(1, expected_idx)
    torch.testing.assert_close(idx_Tk, expected_idx)
    torch.testing.assert_close(weights_Tk, picked / picked.sum(-1, keepdim=True))


def test_a_generated_norm_kind_is_the_norm_the_model_builds(load):
    load("norm", "rms_1p_eps5", "def op(x_TD, weight_D):\n    x = x_TD.float()\n"
         "    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * (1.0 + weight_D.float())).to(x_TD.dtype)\n")
    norm = NormSpec(kind="rms_1p_eps5", eps=0.0)
    assert registry.OPS["rms_norm"].supports(norm) == "variant"
    generated, builtin = make_norm(12, norm), make_norm(12, NormSpec(kind="rms_1p", eps=1e-5))
    assert isinstance(generated, GeneratedNorm)
    with torch.no_grad():
        generated.weight.copy_(builtin.weight.copy_(torch.randn(12) * 0.1))
    x = torch.randn(3, 4, 12)
    torch.testing.assert_close(generated(x), builtin(x))


def test_a_norm_kind_nobody_generated_is_a_clear_error():
    with pytest.raises(KeyError, match="no generated op of that name"):
        make_norm(4, NormSpec(kind="nonesuch", eps=1e-6))


def test_a_generated_rope_type_gives_the_rotary_tables(load):
    load("rope", "quarter", "def op(positions_T, inv_freq_R):\n    angles = positions_T[:, None] * (inv_freq_R / 4.0)[None, :]\n"
         "    return torch.stack([angles.cos(), angles.sin()], dim=-1)\n")
    rope = RopeSpec(theta=10000.0, rotary_dim=16, scaling={"rope_type": "quarter"})
    assert registry.OPS["rope"].supports(rope) == "variant"
    positions = torch.arange(37).expand(2, -1)
    cos, sin = cos_sin(rope, positions)
    inv_freq, _ = rope_inv_freq(16, 10000.0, {"rope_type": "linear", "factor": 4.0})
    expected_cos, expected_sin = rope_cos_sin(positions, inv_freq)
    torch.testing.assert_close(cos, expected_cos)
    torch.testing.assert_close(sin, expected_sin)


@pytest.fixture(scope="module")
def next_config(example_spec) -> ModelSpec:
    """Qwen3-Next's tiny spec: layers 0-2 gated delta + MoE, layer 3 softmax + MoE."""
    return read_spec(example_spec("qwen3_next"))


def test_a_generated_decay_is_the_gated_delta_layers_decay(load, next_config):
    load("linear_attention_decay", "twice", "def op(a_BTH, A_log_H, dt_bias_H):\n"
         "    return -torch.exp(A_log_H.float()) * (2.0 * F.softplus(a_BTH.float() + dt_bias_H.float()))\n")
    attention = next_config.layers[0].attention
    twice = attention.model_copy(update={"decay": "twice"})
    assert registry.OPS["gated_delta_rule"].supports(twice) == "variant"
    generated = _randomize(GatedDeltaNet(twice, next_config.hidden_size, 1e-6))
    builtin = GatedDeltaNet(attention, next_config.hidden_size, 1e-6)
    builtin.load_state_dict(generated.state_dict())
    with torch.no_grad():
        builtin.A_log += math.log(2.0)  # -exp(A + log 2) softplus(z) = -exp(A) 2 softplus(z)
    x = torch.randn(1, 9, next_config.hidden_size, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(generated(x), builtin(x), rtol=1e-4, atol=1e-5)


def test_a_generated_residual_mixing_joins_the_blocks(load, next_config):
    load("residual_mixing", "half_skip", "def op(skip_BTD, sublayer_BTD):\n    return 0.5 * skip_BTD + 2.0 * sublayer_BTD\n")
    layer = next_config.layers[3]
    mixed = layer.model_copy(update={"residual": layer.residual.model_copy(update={"mixing": "half_skip"})})
    scaled = layer.model_copy(update={"residual": layer.residual.model_copy(update=dict(
        attn_alpha=0.5, attn_beta=2.0, ffn_alpha=0.5, ffn_beta=2.0))})
    generated = _randomize(DecoderLayer(mixed, next_config.hidden_size, next_config.norm, 3))
    builtin = DecoderLayer(scaled, next_config.hidden_size, next_config.norm, 3)
    builtin.load_state_dict(generated.state_dict())
    x = torch.randn(1, 7, next_config.hidden_size, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(7).expand(1, -1)
    torch.testing.assert_close(generated(x, RotaryCache(positions)), builtin(x, RotaryCache(positions)))


def test_generated_ops_run_eagerly_on_cpu_and_compiled_on_cuda():
    def op(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) ** 2

    wrapped = package_ops.CompiledOnCuda(op)
    assert wrapped.for_device("cpu") is op
    compiled = wrapped.for_device("cuda")
    assert compiled is not op and compiled is wrapped.for_device("cuda")  # compiled once, at first use
    # no GPU here: the compiled callable the CUDA path uses is run on CPU tensors (inductor's CPU backend)
    x = torch.randn(6, 5, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_(True)
    out = compiled(x)
    torch.testing.assert_close(out, op(x_eager))
    out.sum().backward()
    op(x_eager).sum().backward()
    torch.testing.assert_close(x.grad, x_eager.grad)
    torch.testing.assert_close(wrapped(x_eager.detach()), op(x_eager.detach()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path needs a GPU (none on the CPU CI machine)")
def test_on_cuda_a_generated_op_runs_compiled_and_matches_eager():
    def op(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) ** 2

    wrapped = package_ops.CompiledOnCuda(op)
    x = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(wrapped(x), op(x))
    assert wrapped._compiled is not None  # the call went through the compiled form
