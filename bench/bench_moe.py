"""MoE block benchmark: the runtime's MoE layer (runtime/model/layers/ffn.py: router, fused Triton experts
whose down projection is Gluon on Hopper, gated shared expert) vs transformers' Qwen3NextSparseMoeBlock
with grouped_mm experts, same weights (the layer is built over transformers' Parameter objects), bf16,
one GPU.

Shape legend: T tokens, D model width, E experts, F expert width, k top-k, r LoRA rank.

    PYTHONUNBUFFERED=1 python bench/bench_moe.py [--T 16384] [--out DIR]

Timings (bench/timing.py: CUDA events, median): forward, and forward+backward w.r.t. the input and
every weight (full fine-tune); then frozen base weights (input grad only, and LoRA r16 on the experts); the
fwd+bwd steps also in GPU time (`*_gpu`: the profiler's kernel time, the median of five profiles of three eager
steps, so kernels at the clocks of a GPU that the host leaves idle between launches) and as CUDA graphs replayed back to
back in steady state (`*_graph`: what a trainer's graphed steps run at; our kernels then meet the power cap and run
slower than in a profile, transformers' hardly: `git show 99a26d7:bench/NOTES.md`).
Correctness at the real shape: the bf16 kernels vs the torch form run in fp64 with the same
routing fed to both; the fused router vs the fp64 reference on the same logits; the shared expert vs
its torch form in fp64; routing flips against transformers' bf16 router are counted separately.
Writes moe.json (moe-<T>.json for --T other than 16384) under --out. What was tried: `git show 99a26d7:bench/NOTES.md`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import kernel_ms, peak_gib, steady_graph_ms, time_ms  # noqa: E402
from reference_ops import moe as reference_moe  # noqa: E402
from runtime.ops.mlp import kernel as mlp_kernels  # noqa: E402
from runtime.spec import MoEFFN, RouterSpec
from runtime.ops.moe import kernel as kernels  # noqa: E402
from runtime.model.layers.ffn import MoE  # noqa: E402
from runtime.ops.mlp import torch_form as mlp_torch_form  # noqa: E402
from runtime.ops.moe import torch_form  # noqa: E402
from runtime.tolerances import compare, tolerance_for  # noqa: E402

D, E, K_TOP, F_EXPERT, F_SHARED, RANK = 2048, 512, 10, 512, 512, 16
DEVICE = "cuda"


def build_block():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    cfg = Qwen3NextConfig(hidden_size=D, num_experts=E, num_experts_per_tok=K_TOP, moe_intermediate_size=F_EXPERT,
                          shared_expert_intermediate_size=F_SHARED, norm_topk_prob=True, experts_implementation="grouped_mm")
    block = Qwen3NextSparseMoeBlock(cfg).to(DEVICE, torch.bfloat16)
    assert block.experts.config._experts_implementation == "grouped_mm"
    g = torch.Generator(device=DEVICE).manual_seed(0)
    with torch.no_grad():
        for _, p in block.named_parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
    return block


MOE_CONFIG = MoEFFN(
    num_experts=E, top_k=K_TOP, expert_intermediate_size=F_EXPERT, num_shared_experts=1,
    shared_intermediate_size=F_SHARED, shared_expert_gate=True,
    router=RouterSpec(scoring="softmax", norm_topk_prob=True))
_RUNTIME_LAYERS = {}


def runtime_layer(block) -> MoE:
    """The runtime's MoE layer over transformers' parameters (the same Parameter objects, so the
    gradients of either land on both)."""
    if id(block) not in _RUNTIME_LAYERS:
        # on the meta device: every parameter is replaced below, so none is allocated
        with torch.device("meta"):
            moe = MoE(MOE_CONFIG, D)
        se = block.shared_expert
        moe.router.weight = block.gate.weight
        moe.experts.w_gate_up, moe.experts.w_down = block.experts.gate_up_proj, block.experts.down_proj
        moe.shared.gate_proj.weight, moe.shared.up_proj.weight = se.gate_proj.weight, se.up_proj.weight
        moe.shared.down_proj.weight, moe.shared_gate.weight = se.down_proj.weight, block.shared_expert_gate.weight
        _RUNTIME_LAYERS[id(block)] = moe
    return _RUNTIME_LAYERS[id(block)]


def ours(block, x_TD, lora=None):
    """The runtime's MoE.forward; with `lora` (the layer takes none) the same modules step by step,
    the experts op given the adapters."""
    moe = runtime_layer(block)
    if lora is None:
        return moe(x_TD.view(1, *x_TD.shape)).view(x_TD.shape)
    weights_Tk, idx_Tk = moe.router(x_TD)
    y_TD = kernels.swiglu_experts(x_TD, weights_Tk, idx_Tk, block.experts.gate_up_proj, block.experts.down_proj,
                                  lora_gate_up=lora[0], lora_down=lora[1], lora_scale=2.0)
    return moe.add_shared(x_TD, y_TD)


def transformers_block(block):
    return lambda t: block(t.view(1, *t.shape)).view(t.shape)


def make_lora(device, dtype):
    g = torch.Generator(device=device).manual_seed(1)
    shapes = [(E, RANK, D), (E, 2 * F_EXPERT, RANK), (E, RANK, F_EXPERT), (E, D, RANK)]
    A_gu, B_gu, A_d, B_d = (torch.randn(s, device=device, generator=g).mul_(s[-1] ** -0.5).to(dtype).requires_grad_() for s in shapes)
    return (A_gu, B_gu), (A_d, B_d)


def train_step(fn, x, dy, params):
    def step():
        for p in params:
            p.grad = None
        x.grad = None
        fn(x).backward(dy)
    return step


def timings(block, x, dy):
    params = list(block.parameters())
    hf = transformers_block(block)
    res = {}
    with torch.no_grad():
        res["hf_fwd"] = time_ms(lambda: hf(x))
        res["ours_fwd"] = time_ms(lambda: ours(block, x))
    res["hf_fwd_bwd"] = time_ms(train_step(hf, x, dy, params))
    torch.cuda.reset_peak_memory_stats()
    res["ours_fwd_bwd"] = time_ms(train_step(lambda t: ours(block, t), x, dy, params))
    res["ours_peak_gib"] = peak_gib()
    res["hf_fwd_bwd_gpu"] = gpu_ms(train_step(hf, x, dy, params))
    res["ours_fwd_bwd_gpu"] = gpu_ms(train_step(lambda t: ours(block, t), x, dy, params))
    graphed = steady_graph_ms({"hf": train_step(hf, x, dy, params),
                               "ours": train_step(lambda t: ours(block, t), x, dy, params)})
    res["hf_fwd_bwd_graph"], res["ours_fwd_bwd_graph"] = graphed["hf"], graphed["ours"]
    print(f"timings: {res}", flush=True)
    return res


def gpu_ms(step, rounds: int = 5) -> float:
    """The step's GPU time (every kernel, no host time or launch gaps): eager wall time at these sizes moves
    with the host's speed, for transformers' block most (`git show 99a26d7:bench/NOTES.md`). The median of
    `rounds` profiles of three steps each: one profile of our step moved by up to 2% between runs."""
    return statistics.median(sum(kernel_ms(step).values()) for _ in range(rounds))


def frozen_timings(block, x, dy):
    """Base weights frozen: input grad only, and LoRA adapters on the experts (LoRA grads too)."""
    for p in block.parameters():
        p.requires_grad_(False)
    lora = make_lora(DEVICE, torch.bfloat16)
    adapters = [*lora[0], *lora[1]]
    try:
        res = {
            "hf_frozen_fwd_bwd": time_ms(train_step(transformers_block(block), x, dy, [])),
            "ours_frozen_fwd_bwd": time_ms(train_step(lambda t: ours(block, t), x, dy, [])),
            "ours_lora_fwd_bwd": time_ms(train_step(lambda t: ours(block, t, lora=lora), x, dy, adapters)),
            "hf_frozen_fwd_bwd_gpu": gpu_ms(train_step(transformers_block(block), x, dy, [])),
            "ours_frozen_fwd_bwd_gpu": gpu_ms(train_step(lambda t: ours(block, t), x, dy, [])),
        }
        graphed = steady_graph_ms({"hf": train_step(transformers_block(block), x, dy, []),
                                   "ours": train_step(lambda t: ours(block, t), x, dy, [])})
        res["hf_frozen_fwd_bwd_graph"], res["ours_frozen_fwd_bwd_graph"] = graphed["hf"], graphed["ours"]
        with torch.no_grad():
            res["router_only"] = time_ms(lambda: kernels.route(torch_form.router_logits(x, block.gate.weight), K_TOP,
                                                               norm_topk_prob=True))
    finally:
        for p in block.parameters():
            p.requires_grad_(True)
    print(f"frozen: {res}", flush=True)
    return res


def _reference(inputs: dict, idx, dy, fp64_fn, fixed=None) -> dict:
    """fp64_fn on fp64 copies of the inputs: 'out' and the gradient of every input, computed once
    and shared by every implementation checked against it. `fixed` take part without gradients."""
    ref_in = {n: t.detach().double().requires_grad_() for n, t in inputs.items()}
    expected = fp64_fn(ref_in | {n: t.detach().double() for n, t in (fixed or {}).items()}, idx)
    expected.backward(dy.double())
    ref = {"out": expected.detach()} | {n: ref_in[n].grad for n in inputs}
    del ref_in, expected
    torch.cuda.empty_cache()
    return ref


def _errors(fn, inputs: dict, idx, dy, ref: dict, fixed=None):
    """rel RMS of out and every input grad: fn on bf16 inputs vs the fp64 reference `ref`."""
    ours_in = {n: t.detach().requires_grad_() for n, t in inputs.items()}
    out = fn(ours_in | (fixed or {}), idx)
    out.backward(dy)
    got = {"out": out} | {n: ours_in[n].grad for n in inputs}
    errs = {n: compare(got[n], ref[n], tolerance_for("swiglu_experts", torch.bfloat16, "out" if n == "out" else "grad"))
            for n in got}
    return {n: dict(rel_rms=c.rel_rms, max_abs_rel=c.max_abs_rel, passed=c.passed) for n, c in errs.items()}


def _experts_call(fn):
    def call(t, idx):
        extra = {}
        if "A_gu" in t:
            extra = dict(lora_gate_up=(t["A_gu"], t["B_gu"]), lora_down=(t["A_d"], t["B_d"]), lora_scale=2.0)
        return fn(t["x"], t["weights"], idx, t["w_gu"], t["w_d"], **extra)
    return call


def _shared_call(fn):
    # the kernel writes the residual in place: each call gets its own copy
    def call(t, idx):
        return fn(t["x"], t["w_gate"], t["w_up"], t["w_down"], gate_1D=t["gate"], residual_TD=t["residual"].clone())
    return call


def _shared_errors(block, x, dy) -> dict:
    """The runtime's shared expert (gate/up/gate-row GEMM, Triton activation, down GEMM adding into
    the routed output) in bf16 vs its torch form in fp64: out and every gradient."""
    se = block.shared_expert
    inputs = dict(x=x, w_gate=se.gate_proj.weight, w_up=se.up_proj.weight, w_down=se.down_proj.weight,
                  gate=block.shared_expert_gate.weight, residual=torch.randn_like(x))
    ref = _reference(inputs, None, dy, _shared_call(mlp_torch_form.swiglu_mlp))
    res = _errors(_shared_call(mlp_kernels.swiglu_mlp), inputs, None, dy, ref)
    return res


def _router_errors(block, x) -> dict:
    """The fused router vs the fp64 reference on the same bf16 logits: tokens whose expert sets
    differ (ties, fp32 rounding), then the weights and the logit gradient over the others."""
    logits = F.linear(x, block.gate.weight).detach().requires_grad_()
    logits64 = logits.detach().double().requires_grad_()
    weights, idx = kernels.route(logits, K_TOP, norm_topk_prob=True)
    weights64, idx64 = reference_moe.route(logits64, K_TOP, norm_topk_prob=True)
    same = (idx == idx64).all(1)
    cot = torch.randn_like(weights64) * same[:, None]
    weights.backward(cot.float())
    weights64.backward(cot)
    res = {"tokens_with_other_experts": int((~same).sum())}
    for name, got, want, dtype in (("weights", weights, weights64, torch.float32),
                                   ("logits_grad", logits.grad, logits64.grad, logits.dtype)):
        c = compare(got[same], want[same], tolerance_for("route", dtype, "out" if name == "weights" else "grad"))
        res[name] = dict(rel_rms=c.rel_rms, max_abs_rel=c.max_abs_rel, passed=c.passed)
    return res


def correctness(block, x, dy):
    with torch.no_grad():
        weights, idx = kernels.route(F.linear(x, block.gate.weight), K_TOP, norm_topk_prob=True)
        _, _, hf_idx = block.gate(x)
    flips = int((torch.sort(hf_idx, 1).values != torch.sort(idx, 1).values).any(1).sum())
    inputs = dict(x=x, weights=weights, w_gu=block.experts.gate_up_proj, w_d=block.experts.down_proj)
    ref_fn = _experts_call(torch_form.swiglu_experts)
    res = {"routing_flips_vs_transformers": flips, "router": _router_errors(block, x)}
    ref = _reference(inputs, idx, dy, ref_fn)
    res["full"] = _errors(_experts_call(kernels.swiglu_experts), inputs, idx, dy, ref)

    def hf_experts(t, i):
        swapped = {"gate_up_proj": t["w_gu"], "down_proj": t["w_d"]}
        return torch.func.functional_call(block.experts, swapped, (t["x"], i, t["weights"].to(torch.bfloat16)))

    res["transformers_grouped_mm"] = _errors(hf_experts, inputs, idx, dy, ref)
    del ref
    res["shared_expert"] = _shared_errors(block, x, dy)
    (A_gu, B_gu), (A_d, B_d) = make_lora(DEVICE, torch.bfloat16)
    lora_in = dict(x=x, A_gu=A_gu, B_gu=B_gu, A_d=A_d, B_d=B_d)
    frozen = dict(weights=weights, w_gu=block.experts.gate_up_proj.detach(), w_d=block.experts.down_proj.detach())
    ref = _reference(lora_in, idx, dy, ref_fn, fixed=frozen)
    res["lora_frozen_base"] = _errors(_experts_call(kernels.swiglu_experts), lora_in, idx, dy, ref, fixed=frozen)
    print(f"correctness: {res}", flush=True)
    return res


def summarize(result: dict) -> dict:
    """The TARGETS.md fields from the stages' results."""
    t, frozen = result["timings"], result["frozen_timings"]
    errs = [v["rel_rms"] for k in ("full", "lora_frozen_base", "shared_expert") for v in result["correctness"][k].values()]
    return {"baseline_ms": t["hf_fwd_bwd"], "ours_ms": t["ours_fwd_bwd"], "speedup": t["hf_fwd_bwd"] / t["ours_fwd_bwd"],
            "frozen_speedup": frozen["hf_frozen_fwd_bwd"] / frozen["ours_frozen_fwd_bwd"],
            "gpu_speedup": t["hf_fwd_bwd_gpu"] / t["ours_fwd_bwd_gpu"],
            "gpu_frozen_speedup": frozen["hf_frozen_fwd_bwd_gpu"] / frozen["ours_frozen_fwd_bwd_gpu"],
            "graph_speedup": t["hf_fwd_bwd_graph"] / t["ours_fwd_bwd_graph"],
            "graph_frozen_speedup": frozen["hf_frozen_fwd_bwd_graph"] / frozen["ours_frozen_fwd_bwd_graph"],
            "max_rel_err": max(errs)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, default=16384)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    block = build_block()
    g = torch.Generator(device=DEVICE).manual_seed(2)
    x = torch.randn(args.T, D, device=DEVICE, dtype=torch.bfloat16, generator=g).requires_grad_()
    dy = torch.randn(args.T, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    result = {"name": "moe", "device": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
              "tokens": args.T, "shape": f"T{args.T} D{D} E{E} k{K_TOP} F{F_EXPERT} shared{F_SHARED} bf16",
              "baseline": "transformers Qwen3NextSparseMoeBlock, experts_implementation=grouped_mm, fwd+bwd w.r.t. "
                          "input and all weights",
              "command": f"PYTHONUNBUFFERED=1 python bench/bench_moe.py --T {args.T} --out $OUT",
              "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                           "triton": __import__("triton").__version__}}
    for stage in (timings, frozen_timings, correctness):
        result[stage.__name__] = stage(block, x, dy)
    result |= summarize(result)
    print({k: result[k] for k in ("baseline_ms", "ours_ms", "speedup", "frozen_speedup", "gpu_speedup", "gpu_frozen_speedup",
                                  "graph_speedup", "graph_frozen_speedup", "max_rel_err")}, flush=True)
    os.makedirs(args.out, exist_ok=True)
    # the committed names: moe.json at the default 16384 tokens, moe-<T>.json at any other count
    name = "moe.json" if args.T == 16384 else f"moe-{args.T}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
