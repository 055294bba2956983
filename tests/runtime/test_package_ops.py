"""runtime/package_ops.py: a package's generated op of each kind is registered at load and the runtime layer
that the spec names it in calls it: router scoring, norm, rope, gated-delta decay, residual mixing (the
activation slot is exercised end to end in tests/agents/test_onboard.py). Each generated op here computes
a form the runtime also has another way (e.g. 2 x softplus decay = softplus decay with A_log + log 2), so the
layer's output through the slot is checked against the built-in path, not against the op itself. On CUDA the
runtime calls the op through torch.compile; there is no GPU here, so that path is checked by the wrapper it
picks per device type and by compiling a candidate for real on CPU. Last, what a package's ops/ may not do: run
unapproved, change after its hash was checked, replace a built-in op, or be anything but Python files."""
from __future__ import annotations

import hashlib
import math
import os

import pytest
import torch
import torch.nn.functional as F

from runtime import package_ops, registry
from runtime.spec import ModelSpec, MoEFFN, NormSpec, RopeSpec, RouterSpec, read_spec
from runtime.model.layers.ffn import Router
from runtime.model.layers.linear_attention import GatedDeltaNet
from runtime.model.layers.norm import GeneratedNorm, make_norm
from runtime.model.decoder import DecoderLayer
from runtime.ops.moe.torch_form import route
from runtime.ops.rope.torch_form import rope_cos_sin, rope_inv_freq
from runtime.model.rotary import RotaryCache, cos_sin

HEADER = "import math\nimport torch\nimport torch.nn.functional as F\nKIND = {kind!r}\nNAME = {name!r}\n\n"


@pytest.fixture
def load(tmp_path):
    """Writes one generated op into a package's ops/ and loads it; the runtime's tables are restored after."""
    saved = {kind: dict(table) for kind, table in package_ops.TABLES.items()}

    def write_and_load(kind: str, name: str, body: str) -> None:
        (tmp_path / "ops").mkdir(exist_ok=True)
        (tmp_path / "ops" / f"{kind}_{name}.py").write_text(HEADER.format(kind=kind, name=name) + body)
        # approved here: the file is this test's own (the approval rules are tested below)
        approved = {f.sha256 for f in package_ops.read_op_files(tmp_path)}
        assert f"{kind}:{name}" in package_ops.load_package_ops(tmp_path, approved)

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


MARKING_OP = ("import pathlib\npathlib.Path({mark!r}).write_text('ran')\n"
              "KIND = 'activation'\nNAME = 'marked'\n\n\ndef op(x):\n    return x * {factor}\n")


def _package_with(tmp_path, files: dict[str, str]):
    (tmp_path / "ops").mkdir()
    for name, text in files.items():
        (tmp_path / "ops" / name).write_text(text)
    return tmp_path


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_unapproved_file_is_refused_before_any_of_the_package_runs(tmp_path):
    """The approved op would run first in sorted order: nothing runs while one file is unapproved."""
    mark = tmp_path / "ran"
    pkg = _package_with(tmp_path, {"a_op.py": MARKING_OP.format(mark=str(mark), factor=2),
                                   "b_notes.py": "raise SystemExit('never')\n"})
    with pytest.raises(package_ops.PackageOpRefused, match=r"ops/b_notes.py is not approved: review it, then run "
                                                           r"`onboard approve "):
        package_ops.load_package_ops(pkg, {_sha(pkg / "ops" / "a_op.py")})
    assert not mark.exists() and "marked" not in package_ops.TABLES["activation"]


def test_the_op_registered_is_the_one_whose_bytes_were_hashed(tmp_path):
    """Read once: a file rewritten after the read (between check and import) does not change what runs."""
    mark = tmp_path / "ran"
    pkg = _package_with(tmp_path, {"activation_marked.py": MARKING_OP.format(mark=str(mark), factor=2)})
    files = package_ops.read_op_files(pkg)
    package_ops.check_approved(pkg, files, {files[0].sha256})
    (pkg / "ops" / "activation_marked.py").write_text(MARKING_OP.format(mark=str(mark), factor=3))
    assert package_ops.register_op_files(files) == ["activation:marked"]
    torch.testing.assert_close(package_ops.TABLES["activation"]["marked"](torch.ones(2)), torch.full((2,), 2.0))


def test_an_op_may_not_replace_a_builtin_or_another_op_of_the_package(tmp_path):
    silu = "import torch.nn.functional as F\nKIND = 'activation'\nNAME = 'silu'\n\n\ndef op(x):\n    return 1.5 * F.silu(x)\n"
    pkg = _package_with(tmp_path, {"activation_silu.py": silu})
    builtin = package_ops.TABLES["activation"]["silu"]
    with pytest.raises(package_ops.PackageOpRefused, match=r"activation_silu.py declares NAME 'silu', a built-in activation"):
        package_ops.load_package_ops(pkg, {_sha(pkg / "ops" / "activation_silu.py")})
    assert package_ops.TABLES["activation"]["silu"] is builtin
    twice = MARKING_OP.format(mark=str(tmp_path / "m"), factor=2)
    (pkg / "ops" / "activation_silu.py").unlink()
    for name in ("a.py", "b.py"):
        (pkg / "ops" / name).write_text(twice)
    with pytest.raises(package_ops.PackageOpRefused, match=r"b.py declares activation 'marked', which a.py declares too"):
        package_ops.load_package_ops(pkg, {_sha(pkg / "ops" / "a.py")})


@pytest.mark.parametrize("entry", ["notes.txt", "folder", "link.py", "fifo.py"])
def test_anything_but_a_python_file_in_ops_is_refused_even_approved(tmp_path, entry):
    pkg = _package_with(tmp_path, {})
    path = pkg / "ops" / entry
    if entry == "notes.txt":
        path.write_text("review me")
    elif entry == "folder":
        path.mkdir()
        (path / "op.py").write_text("KIND = 'activation'\n")
    elif entry == "link.py":
        (tmp_path / "elsewhere.py").write_text(MARKING_OP.format(mark=str(tmp_path / "m"), factor=2))
        path.symlink_to(tmp_path / "elsewhere.py")
    else:
        os.mkfifo(path)
    approved = {f.sha256 for f in package_ops.read_op_files(pkg) if f.sha256}
    with pytest.raises(package_ops.PackageOpRefused, match=rf"ops/{entry} is (not a Python file|a folder|a symbolic "
                                                           r"link|not a regular file)"):
        package_ops.load_package_ops(pkg, approved)


def test_bytecode_caches_are_ignored_and_failing_modules_are_refused_in_one_line(tmp_path):
    """__pycache__ is what running the ops' unit tests leaves (never loaded: ops compile from their hashed bytes);
    an approved module that raises is a refusal naming it, not a traceback."""
    pkg = _package_with(tmp_path, {"activation_bad.py": "import no_such_module_here\n"})
    (pkg / "ops" / "__pycache__").mkdir()
    (pkg / "ops" / "__pycache__" / "activation_bad.cpython-311.pyc").write_bytes(b"\x00" * 16)
    assert [f.path.name for f in package_ops.read_op_files(pkg)] == ["activation_bad.py"]
    with pytest.raises(package_ops.PackageOpRefused, match=r"activation_bad.py failed to load: ModuleNotFoundError"):
        package_ops.load_package_ops(pkg, {_sha(pkg / "ops" / "activation_bad.py")})


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) ** 2


# what validation cannot see: the op tells the sandbox (HOME is its work dir) from the process it runs in
RIGHT_ONLY_IN_THE_SANDBOX = ("def op(x):\n    env = torch.serialization.os.environ\n"
                             "    sandboxed = env.get('HOME') == torch.serialization.os.getcwd()\n"
                             "    return torch.relu(x) ** 2 if sandboxed else torch.relu(x)\n")


def test_an_armed_generated_op_is_spot_checked_on_its_first_real_call(load):
    load("activation", "relu2", RIGHT_ONLY_IN_THE_SANDBOX)
    assert package_ops.arm_spot_checks({"activation": {"relu2": _relu2}}) == ["activation:relu2"]
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with pytest.raises(package_ops.GeneratedOpMismatch, match="generated op activation:relu2 disagrees"):
        package_ops.TABLES["activation"]["relu2"](x)


def test_a_right_generated_op_passes_its_spot_check_once_and_runs_unchanged(load):
    load("activation", "relu2", "def op(x):\n    return torch.relu(x) ** 2\n")
    package_ops.arm_spot_checks({"activation": {"relu2": _relu2}})
    wrapped = package_ops.TABLES["activation"]["relu2"]
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out = wrapped(x)
    out.sum().backward()
    torch.testing.assert_close(out, _relu2(x))
    torch.testing.assert_close(x.grad, 2 * torch.relu(x.detach()))
    assert wrapped._spot_check is None  # checked once: later steps pay nothing
