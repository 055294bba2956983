"""MoE block benchmark: the runtime's MoE layer (runtime/layers/ffn.py: router, fused Triton experts,
gated shared expert) vs transformers' Qwen3NextSparseMoeBlock with grouped_mm experts, same
weights (the layer is built over transformers' Parameter objects), bf16, one GPU.

Shape legend: T tokens, D model width, E experts, F expert width, k top-k, r LoRA rank.

    PYTHONUNBUFFERED=1 python bench/bench_moe.py [--T 16384] [--out DIR] [--sweep]

--sweep first times each expert GEMM alone under each config, with x / dy read gathered by token
and from a copy in expert order, and the copy and k-row-sum passes (what decided the layout in
runtime/kernels/moe/experts.py).

Timings (CUDA events, median): forward, and forward+backward w.r.t. the input and every weight
(full fine-tune); then the frozen-base variants (input grad only, and LoRA r16 on the experts).
Correctness at the real shape: the bf16 kernel vs the torch fallback run in fp64 (its loop over
experts, checked against reference_ops by tests/test_ref_moe.py) with the same routing fed to
both; routing flips between transformers' bf16 router and ours are counted separately.

Variants (VARIANTS: a runtime.kernels.moe.Tuning, the routing rule, the logits' form, the shared
expert's form, or the layer's forward as is) have their experts checked against the same fp64
reference (full fine-tune and LoRA frozen base), and are timed side by side with the default path
and transformers in one run, in interleaved rounds (`variant_timings`, `lora_variant_timings`).
The `graph baseline` row replays one fwd+bwd captured in a CUDA graph: what launch gaps remain
(a bench form only; the runtime does not capture the layer). `correctness.router` checks the fused
router against the fp64 reference on the same bf16 logits; `correctness.shared_expert` the shared
expert (with its gate, adding into a routed output) against its torch form in fp64.

Measured 2026-11-29 (H200, T 16384, this command): transformers 16.67 ms fwd+bwd, ours 12.28
(1.36x), 10.9 ms of it GPU time. In the same rounds (transformers 17.04, ours 12.83): glu_bwd_m64
12.44 (adopted), fused_x_copy 12.70 but WRONG on the GPU (out rel RMS 0.28, passed in the
interpreter; removed), scaled_h 13.19 and wgrad split-K 29.0 (removed).

Measured 2026-11-29 (H200, torch 2.11, triton 3.6, this command, bench/results/2026-11-29-moe-run2.json):
transformers 16.80 ms, ours 11.33 (1.48x); in interleaved rounds transformers 16.97, baseline
11.59 (1.465x), torch_router 12.01, glu_bwd_m128 11.69, glu_bwd_scaled_h 11.75 (predicted -0.25:
wrong, removed), m64_all 12.60, m64_all_scaled_h 12.49 (both removed), graph baseline
11.24; transformers graphed 16.16. GPU profile of baseline ~10.9 ms: grouped GEMMs 5.15, weight
grads 3.35, sum_k 0.34, gather 0.30, torch elementwise 0.41 (7 launches), cuBLAS shared expert /
router / gate ~0.65 (12 launches + split-K reduces), gate GEMV 0.06, reduce 0.02.

Measured 2026-11-29, third run (same command, bench/results/2026-11-29-moe-run3.json, the shared expert fused as
predicted below): transformers 17.00 ms, ours 11.30 (1.505x); in the rounds transformers 17.25,
step-by-step layer 11.46 (1.505x; predicted ~11.2), torch_router 11.82, glu_bwd_m128 11.69,
torch_shared 12.45 (predicted +0.35: measured +0.99), fp32_router_logits 13.24 (predicted +1.9:
+1.78), MoE.forward itself 12.05 (predicted = step by step: +0.59, unexplained), graph 11.11.
So `baseline` and `timings` now time MoE.forward itself (the runtime), `step_by_step` the same
modules called one by one.
What that run measured (predictions then, against 11.59):
- the shared expert is runtime.kernels.moe.swiglu_mlp:
  gate, up and the shared-expert gate row in one cuBLAS GEMM (N = 1032: 1024 + 1 + 7 zero rows),
  a Triton activation pass each way that applies sigmoid(s) to h and gives d(s), and the down GEMM
  adding into the routed output in place. Gone: the broadcast multiply fwd and bwd (0.17), the
  y + shared add, the dy * shared product and its row reduce, silu / mul and their backward, the
  gate GEMV fwd/bwd (~0.06), two of the four dx accumulations (~0.1): ~0.45 ms of GPU, for ~0.06
  of Triton passes and the 4 MB weight cat: ~-0.35 GPU, ~-0.05 host launches. Counter: the router
  logits are now fp32 from a bf16 GEMM (runtime/ops/moe.py router_logits, the layer's precision)
  where the bench had bf16 logits: +32 MB out, one cast in backward, ~+0.02.
- fp32_router_logits: x and the router weight upcast and multiplied in fp32 without tensor cores,
  as the runtime layer did until then.
- correctness.shared_expert: bf16 kernel vs fp64 torch form.
- Not built: tile order of the grouped GEMMs for L2 reuse. Predicted < 0.05 ms: an expert has ~3
  row tiles x 4-16 column tiles (~320 rows), all in flight together in launch order, and its
  operands (~2 MB) fit in L2 many times over, so weights are already read about once from HBM.
Measured 2026-11-29 14:12 (bench/results/2026-11-29-moe-1412.json), the weight gradients with 4-16
experts per program (predicted 11.3 -> ~10.2 ms fwd+bwd): step_by_step 11.35 ms, wgrad_group4 11.94,
wgrad_group8 11.87, wgrad_group16 11.79, wgrad_group8_ptr_store 11.37 (all passed, worst 3.44e-3);
LoRA frozen base 10.46-10.69 vs step_by_step 10.55 (noise). No faster: removed (that run's file is
bench/results/2026-11-29-moe-1412.json).
Measured 2026-11-29 15:57 with --sweep (bench/results/2026-11-29-moe-sweep.json): torch._grouped_mm (CUTLASS)
takes the gate/up weight gradient from the rows in expert order in 1.59 ms (432 TFLOP/s) against grouped_wgrad's
1.91 (360), and the down one, dy's rows scaled first, in 1.63 against 1.48. Adopted for the gate/up one
(Tuning.torch_gate_up_wgrad; predicted -0.3 ms). 16:03 run (this command, bench/results/2026-11-29-moe-1603.json):
ours 11.02 vs transformers 16.76 ms = 1.52x (`timings`); in the rounds baseline 11.33, triton_gate_up_wgrad
(the path before) 11.55, transformers 17.15: 1.513x, graph baseline 10.82 (1.58x). Its w_gu error is the same
to the last digit either way (rel RMS 3.0e-3); an expert with no rows gets zeros from torch._grouped_mm on the
GPU too (bench/check_sorted_rows_wgrad.py, bench/results/2026-11-29-sorted-rows-wgrad-check.json).
16:34 run with --sweep (bench/results/2026-11-29-moe-sweep-1634.json): the down projection and dx GEMMs through
torch._grouped_mm on rows in expert order take 0.99 and 1.62 ms against grouped_gemm's 1.01-1.04 and 1.30, before
the weighted gather over k torch's form would still need: both stay in grouped_gemm. That run: 11.00 vs 16.97 ms
= 1.54x, in the rounds 11.39 vs 17.12 = 1.50x (triton_gate_up_wgrad 11.81).
18:19 and 18:23 runs: the weight gradients on a second CUDA stream, concurrent with the GLU backward and dx
(predicted 0.2-0.4 ms off): 11.10 against baseline 11.20 ms when forked after the GLU backward
(bench/results/2026-11-29-moe-overlap-1819.json), 11.24 against 11.04 with the down side started before it
(18:23): no faster, removed (commits 7e00d19 and a6e75e2 hold it). The 18:23 run (bench/results/2026-11-29-moe.json;
the 16:03 file renamed -1603): ours 10.76 vs transformers 16.92 ms = 1.57x, in the rounds 11.04 vs 17.22 = 1.56x,
graph baseline 10.65 (1.62x); the 18:19 run 10.81 vs 16.96 = 1.57x, rounds 1.52x.
Writes moe.json under --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import triton

from runtime.kernels import moe as kernels
from reference_ops import moe as reference_moe
from runtime.kernels.moe import combine
from runtime.kernels.moe import experts as kernel_experts
from runtime.kernels.moe import gather
from runtime.kernels.moe import grouped_gemm as gg
from runtime.kernels.moe import grouped_wgrad as gw
from runtime.config import MoEConfig, RouterConfig
from runtime.kernels.moe.schedule import build_schedule
from runtime.layers.ffn import MoE
from runtime.ops import moe as fallback
from runtime.tolerances import compare, tolerance_for

D, E, K_TOP, F_EXPERT, F_SHARED, RANK = 2048, 512, 10, 512, 512, 16
DEVICE = "cuda"
T0 = time.time()
# Kernel variants timed and checked side by side; predictions in the module docstring.
# Each is ours_block's keyword arguments: `tuning` (runtime.kernels.moe.Tuning), `router`, `logits`,
# `shared` and `whole_layer` (see ours_block).
VARIANTS = {
    # the runtime's MoE.forward itself: the headline figure
    "baseline": dict(whole_layer=True),
    # the same modules called step by step (in one run on 2026-11-29 this was 0.6 ms faster than
    # MoE.forward in the same rounds, which nothing in the code explains: kept to see if it repeats)
    "step_by_step": {},
    "torch_router": dict(router=fallback.route),
    "glu_bwd_m128": dict(tuning=kernels.Tuning(glu_bwd_block_m=None)),
    # the gate/up weight gradient in grouped_wgrad instead of torch._grouped_mm (the default until commit 8d8ad01)
    "triton_gate_up_wgrad": dict(tuning=kernels.Tuning(torch_gate_up_wgrad=False)),
    "torch_shared": dict(shared="torch"),
    "fp32_router_logits": dict(logits="fp32"),
}
GRAPHED = ("baseline",)
PROFILED = ("baseline", "triton_gate_up_wgrad")


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def time_ms(fn, reps=10, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


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


MOE_CONFIG = MoEConfig(
    num_experts=E, top_k=K_TOP, expert_intermediate_size=F_EXPERT, num_shared_experts=1,
    shared_intermediate_size=F_SHARED, shared_expert_gate=True,
    router=RouterConfig(scoring="softmax", norm_topk_prob=True))
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


def ours_block(block, x_TD, lora=None, tuning=None, router=None, logits="layer", shared="layer", whole_layer=False):
    """The runtime's MoE layer (runtime/layers/ffn.py MoE.forward, step by step through the same
    modules and ops) with the settings under measurement: `router` (the routing rule applied to the
    layer's logits; None: the layer's Router module), `logits` ("fp32": x and the router weight
    upcast, the layer's former form), `tuning` and `lora` (the experts op; None and None: the
    layer's Experts module), `shared` ("torch": the former torch form of the gated shared expert and
    the add). whole_layer runs MoE.forward itself."""
    moe = runtime_layer(block)
    if whole_layer:
        return moe(x_TD.view(1, *x_TD.shape)).view(x_TD.shape)
    if router is None and logits == "layer":
        weights_Tk, idx_Tk = moe.router(x_TD)
    else:
        w_ED = block.gate.weight
        logits_TE = F.linear(x_TD.float(), w_ED.float()) if logits == "fp32" else fallback.router_logits(x_TD, w_ED)
        weights_Tk, idx_Tk = (router or kernels.route)(logits_TE, K_TOP, norm_topk_prob=True)
    if tuning is None and lora is None:
        y_TD = moe.experts(x_TD, weights_Tk, idx_Tk)
    else:
        extra = {} if lora is None else dict(lora_gate_up=lora[0], lora_down=lora[1], lora_scale=2.0)
        y_TD = kernels.swiglu_experts(x_TD, weights_Tk, idx_Tk, block.experts.gate_up_proj, block.experts.down_proj,
                                      tuning=tuning or kernels.Tuning(), **extra)
    if shared == "torch":
        se = block.shared_expert
        return fallback.swiglu_mlp(x_TD, se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight,
                                   gate_1D=block.shared_expert_gate.weight, residual_TD=y_TD)
    return moe.add_shared(x_TD, y_TD)


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
    hf = lambda t: block(t.view(1, *t.shape)).view(t.shape)  # noqa: E731
    ours = lambda t: ours_block(block, t, whole_layer=True)  # noqa: E731  (the runtime's MoE.forward)
    res = {}
    with torch.no_grad():
        res["hf_fwd"] = time_ms(lambda: hf(x))
        res["ours_fwd"] = time_ms(lambda: ours(x))
    log(f"fwd: hf {res['hf_fwd']:.2f} ms, ours {res['ours_fwd']:.2f} ms")
    res["hf_fwd_bwd"] = time_ms(train_step(hf, x, dy, params))
    res["ours_fwd_bwd"] = time_ms(train_step(ours, x, dy, params))
    log(f"fwd+bwd full: hf {res['hf_fwd_bwd']:.2f}, ours {res['ours_fwd_bwd']:.2f} ms")
    return res


def profile(block, x, dy):
    """Where one full fwd+bwd of ours spends its GPU time, by kernel name, for PROFILED variants."""
    res = {}
    for name in PROFILED:
        step = train_step(lambda t: ours_block(block, t, **VARIANTS[name]), x, dy, list(block.parameters()))
        try:
            step()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
        except Exception as error:
            res[name] = _describe(error)
            continue
        res[name] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60)
        print(f"profile {name}\n{res[name]}", flush=True)
    return res


def _rounds(steps: dict, rounds=3) -> dict:
    """Median ms of each step over interleaved rounds, so drift hits every variant alike."""
    times = {name: [] for name in steps}
    for r in range(rounds):
        for name, step in steps.items():
            times[name].append(time_ms(step))
        log(f"round {r}: " + ", ".join(f"{n} {t[-1]:.2f}" for n, t in times.items()))
    return {name: statistics.median(t) for name, t in times.items()}


def _graphed(fn, x, dy, params):
    """One fwd+bwd of fn captured in a CUDA graph. Warm-up (autotuning, allocator) runs on a side
    stream first; grads are None at capture, so the captured backward allocates them from the
    graph's pool and each replay rewrites them (torch's whole-network capture recipe)."""
    step = train_step(fn, x, dy, params)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in [x, *params]:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x).backward(dy)
    return graph


def _graph_vs_eager(graph, fn, x, dy, params) -> dict:
    """Worst rel RMS between the grads of a replay and of an eager step (atomics reorder sums)."""
    graph.replay()
    torch.cuda.synchronize()
    replayed = [t.grad.clone() for t in [x, *params]]
    train_step(fn, x, dy, params)()
    tol = tolerance_for("swiglu_experts", torch.bfloat16, "grad")
    worst = max(compare(g, t.grad, tol).rel_rms for g, t in zip(replayed, [x, *params]))
    return {"max_rel_rms": worst, "passed": worst <= tol.rel_rms}


def variant_timings(block, x, dy):
    """Full fwd+bwd of transformers, the default path, each Tuning variant and the CUDA-graph
    replays of GRAPHED, all timed in the same interleaved rounds."""
    params = list(block.parameters())
    hf = lambda t: block(t.view(1, *t.shape)).view(t.shape)  # noqa: E731
    fns = {name: (lambda t, kw=kw: ours_block(block, t, **kw)) for name, kw in VARIANTS.items()}
    steps = {"transformers": train_step(hf, x, dy, params)} | {n: train_step(f, x, dy, params) for n, f in fns.items()}
    steps, failed = _runnable(steps)
    checks = {}
    for name in [n for n in GRAPHED if n in steps]:
        try:
            graph = _graphed(fns[name], x, dy, params)
            checks[name] = _graph_vs_eager(graph, fns[name], x, dy, params)
            steps[f"graph {name}"] = graph.replay
        except Exception as error:
            checks[name] = {"error": _describe(error)}
        log(f"graph {name}: replay vs eager grads {checks[name]}")
    ms = _rounds(steps)
    return {"ms": ms, "speedup_vs_transformers": {n: ms["transformers"] / t for n, t in ms.items()},
            "graph_vs_eager": checks, "failed": failed}


def lora_variant_timings(block, x, dy):
    """Frozen base weights, LoRA r16 on the experts: fwd+bwd of each variant, interleaved rounds."""
    for p in block.parameters():
        p.requires_grad_(False)
    lora = make_lora(DEVICE, torch.bfloat16)
    adapters = [*lora[0], *lora[1]]
    # the runtime layer as is takes no LoRA
    steps = {name: train_step(lambda t, kw=kw: ours_block(block, t, lora=lora, **kw), x, dy, adapters)
             for name, kw in VARIANTS.items() if not kw.get("whole_layer")}
    try:
        steps, failed = _runnable(steps)
        return {"ms": _rounds(steps), "failed": failed}
    finally:
        for p in block.parameters():
            p.requires_grad_(True)


def hf_graph(block, x, dy):
    """transformers' block captured alike, for a like-for-like graph ratio; run last because a
    capture that fails (a host sync inside) can leave the device unusable."""
    params = list(block.parameters())
    graph = _graphed(lambda t: block(t.view(1, *t.shape)).view(t.shape), x, dy, params)
    return {"ms": time_ms(graph.replay)}


def frozen_timings(block, x, dy):
    """Base weights frozen: input grad only, and LoRA adapters on the experts (LoRA grads too)."""
    for p in block.parameters():
        p.requires_grad_(False)
    lora = make_lora(DEVICE, torch.bfloat16)
    adapters = [*lora[0], *lora[1]]
    res = {
        "hf_frozen_fwd_bwd": time_ms(train_step(lambda t: block(t.view(1, *t.shape)).view(t.shape), x, dy, [])),
        "ours_frozen_fwd_bwd": time_ms(train_step(lambda t: ours_block(block, t), x, dy, [])),
        "ours_lora_fwd_bwd": time_ms(train_step(lambda t: ours_block(block, t, lora=lora), x, dy, adapters)),
    }
    with torch.no_grad():
        res["router_only"] = time_ms(lambda: kernels.route(fallback.router_logits(x, block.gate.weight), K_TOP,
                                                              norm_topk_prob=True))
    log(f"frozen: hf {res['hf_frozen_fwd_bwd']:.2f}, ours {res['ours_frozen_fwd_bwd']:.2f}, ours+LoRA {res['ours_lora_fwd_bwd']:.2f}, router {res['router_only']:.2f} ms")
    for p in block.parameters():
        p.requires_grad_(True)
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


def _experts_call(fn, tuning=None):
    def call(t, idx):
        extra = {} if tuning is None else {"tuning": tuning}
        if "A_gu" in t:
            extra |= dict(lora_gate_up=(t["A_gu"], t["B_gu"]), lora_down=(t["A_d"], t["B_d"]), lora_scale=2.0)
        return fn(t["x"], t["weights"], idx, t["w_gu"], t["w_d"], **extra)
    return call


def _variant_errors(inputs, idx, dy, ref, fixed=None) -> dict:
    res = {}
    # a variant that changes only the router runs the baseline's experts, checked once
    tunings = {"baseline": kernels.Tuning()} | {n: kw["tuning"] for n, kw in VARIANTS.items() if "tuning" in kw}
    for name, tuning in tunings.items():
        try:
            res[name] = _errors(_experts_call(kernels.swiglu_experts, tuning), inputs, idx, dy, ref, fixed)
        except Exception as error:  # a variant that fails is reported; the others still run
            res[name] = {"error": _describe(error)}
            log(f"{name} FAILED: {res[name]['error']}")
            continue
        log(f"{name}: worst rel RMS {max(v['rel_rms'] for v in res[name].values()):.2e}, "
            f"all passed {all(v['passed'] for v in res[name].values())}")
    return res


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
    ref = _reference(inputs, None, dy, _shared_call(fallback.swiglu_mlp))
    res = _errors(_shared_call(kernels.swiglu_mlp), inputs, None, dy, ref)
    log(f"shared expert vs fp64: {res}")
    return res


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[:2000]


def _runnable(steps: dict) -> tuple[dict, dict]:
    """Steps that run once without raising (this also autotunes them), and the errors of the rest."""
    ok, failed = {}, {}
    for name, step in steps.items():
        try:
            step()
            ok[name] = step
        except Exception as error:
            failed[name] = _describe(error)
            log(f"{name} FAILED: {failed[name]}")
    return ok, failed


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
    log(f"fused router vs fp64: {res}")
    return res


def correctness(block, x, dy):
    with torch.no_grad():
        weights, idx = kernels.route(F.linear(x, block.gate.weight), K_TOP, norm_topk_prob=True)
        _, _, hf_idx = block.gate(x)
    flips = int((torch.sort(hf_idx, 1).values != torch.sort(idx, 1).values).any(1).sum())
    log(f"routing: {flips} of {x.shape[0]} tokens choose a different expert set in transformers' bf16 router")
    inputs = dict(x=x, weights=weights, w_gu=block.experts.gate_up_proj, w_d=block.experts.down_proj)
    ref_fn = _experts_call(fallback.swiglu_experts)
    res = {"routing_flips_vs_transformers": flips, "router": _router_errors(block, x)}
    ref = _reference(inputs, idx, dy, ref_fn)
    res["full_by_variant"] = _variant_errors(inputs, idx, dy, ref)
    res["full"] = res["full_by_variant"]["baseline"]

    def hf_experts(t, i):
        swapped = {"gate_up_proj": t["w_gu"], "down_proj": t["w_d"]}
        return torch.func.functional_call(block.experts, swapped, (t["x"], i, t["weights"].to(torch.bfloat16)))

    res["transformers_grouped_mm"] = _errors(hf_experts, inputs, idx, dy, ref)
    res["shared_expert"] = _shared_errors(block, x, dy)
    log(f"transformers grouped_mm errors (same routing): {res['transformers_grouped_mm']}")
    del ref
    (A_gu, B_gu), (A_d, B_d) = make_lora(DEVICE, torch.bfloat16)
    lora_in = dict(x=x, A_gu=A_gu, B_gu=B_gu, A_d=A_d, B_d=B_d)
    frozen = dict(weights=weights, w_gu=block.experts.gate_up_proj.detach(), w_d=block.experts.down_proj.detach())
    ref = _reference(lora_in, idx, dy, ref_fn, fixed=frozen)
    res["lora_frozen_base_by_variant"] = _variant_errors(lora_in, idx, dy, ref, fixed=frozen)
    res["lora_frozen_base"] = res["lora_frozen_base_by_variant"]["baseline"]
    return res


GEMM_CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st) for bn, bk, w, st in (
    (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4), (256, 64, 8, 3), (128, 128, 8, 3))]
WGRAD_CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st) for bm, bn, bk, w, st in (
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 3))]
BLOCK_M = 128


def _gemm_cases(block, x, dy):
    """The expert GEMMs of one fwd+bwd on real routing, with x / dy read gathered by token or
    from a copy in expert order: name -> (flops, call(config))."""
    weights, idx = kernels.route(F.linear(x, block.gate.weight), K_TOP, norm_topk_prob=True)
    sched = build_schedule(idx, E, BLOCK_M)
    S = idx.numel()
    w_P = weights.reshape(-1)
    w_gu, w_d = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    x, dy = x.detach(), dy.contiguous()
    x_S, dy_S = gather.gather_tokens(x, sched), gather.gather_tokens(dy, sched)
    new = lambda *shape: torch.empty(shape, device=x.device, dtype=x.dtype)  # noqa: E731
    gate_up, h, y, d_gate_up, dx = new(S, 2 * F_EXPERT), new(S, F_EXPERT), new(S, D), new(S, 2 * F_EXPERT), new(S, D)
    dw = torch.zeros(S, device=x.device)
    flops = 2 * S * D * F_EXPERT
    cases = {
        "down_fwd": (flops, lambda c: gg.grouped_gemm(h, gg.Weight(w_d), sched, y, scatter_out=True, row_scale_P=w_P,
                                                      config=c)),
        "dx": (2 * flops, lambda c: gg.grouped_gemm(d_gate_up, gg.Weight(w_gu, transposed=True), sched, dx,
                                                    scatter_out=True, config=c)),
    }
    for rows, (xr, dyr, by_token) in {"permuted": (x_S, dy_S, False), "gathered": (x, dy, True)}.items():
        cases |= {
            f"glu_fwd {rows}": (2 * flops, lambda c, xr=xr, by_token=by_token: gg.grouped_gemm(
                xr, gg.Weight(w_gu), sched, h, mode=gg.MODE_GLU_FWD, gather_a=by_token, gate_up=gate_up, config=c)),
            f"glu_bwd {rows}": (flops, lambda c, dyr=dyr, by_token=by_token: gg.grouped_gemm(
                dyr, gg.Weight(w_d, transposed=True), sched, d_gate_up, mode=gg.MODE_GLU_BWD, gather_a=by_token,
                row_scale_P=w_P, gate_up=gate_up, dw_P=dw, config=c)),
            f"wgrad_gate_up {rows}": (2 * flops, lambda c, xr=xr, by_token=by_token: gw.grouped_wgrad(
                d_gate_up, xr, sched, gather_b=by_token, config=c)),
            f"wgrad_down {rows}": (flops, lambda c, dyr=dyr, by_token=by_token: gw.grouped_wgrad(
                dyr, h, sched, gather_a=by_token, row_scale_P=w_P, config=c)),
        }
    cases |= _torch_grouped_mm_cases(x_S, dy_S, h, d_gate_up, w_P, sched, flops, (w_gu, w_d))
    return cases, dict(x=x, sched=sched, y=y)


def _torch_grouped_mm_cases(x_S, dy_S, h, d_gate_up, w_P, sched, flops, block_weights):
    """The two weight gradients through torch._grouped_mm (CUTLASS, groups along the reduced rows), as
    transformers' grouped_mm backward computes them, from the rows in expert order: a comparison for
    grouped_wgrad (each call ignores the config; the down one includes scaling dy's rows by the routing weight);
    and the down projection and dx GEMMs the same way, for grouped_gemm."""
    offs = sched.ends_E.to(torch.int32)
    w_S = w_P[sched.pair_S].to(dy_S.dtype)[:, None]
    gate_up = lambda c: torch._grouped_mm(d_gate_up.t(), x_S, offs=offs)  # noqa: E731
    down = lambda c: torch._grouped_mm((dy_S * w_S).t(), h, offs=offs)  # noqa: E731
    try:
        agree = {"gate_up": _rel_rms(gate_up(None), gw.grouped_wgrad(d_gate_up, x_S, sched)),
                 "down": _rel_rms(down(None), gw.grouped_wgrad(dy_S, h, sched, row_scale_P=w_P))}
        log(f"torch._grouped_mm weight gradients vs grouped_wgrad, rel RMS: {agree}")
    except Exception as error:  # an unsupported layout is reported, not fatal
        log(f"torch._grouped_mm weight gradients FAILED {type(error).__name__}: {str(error)[:200]}")
        return {}
    # the two row-side GEMMs whose outputs go back to pair order: torch._grouped_mm leaves them in expert order,
    # so a gather over k (and the routing weight, for down) would follow; timed without it
    w_gu, w_d = block_weights
    return {"wgrad_gate_up torch_grouped_mm": (2 * flops, gate_up), "wgrad_down torch_grouped_mm": (flops, down),
            "down_fwd torch_grouped_mm": (flops, lambda c: torch._grouped_mm(h, w_d.transpose(1, 2), offs=offs)),
            "dx torch_grouped_mm": (2 * flops, lambda c: torch._grouped_mm(d_gate_up, w_gu, offs=offs))}


def _rel_rms(got, want):
    return ((got.float() - want.float()).pow(2).mean() / want.float().pow(2).mean()).sqrt().item()


def _memory_passes(x, sched, y):
    """The passes that the layouts add or change: the copy of x into expert order, the k-row sum."""
    k_rows = y.view(-1, K_TOP, D)
    tokens = sched.pair_S // K_TOP
    res = {"copy_x_to_expert_order torch": time_ms(lambda: x.index_select(0, tokens), reps=5, warmup=1),
           "copy_x_to_expert_order triton": time_ms(lambda: gather.gather_tokens(x, sched), reps=5, warmup=1),
           "sum_k torch": time_ms(lambda: k_rows.sum(dim=1), reps=5, warmup=1),
           "sum_k triton": time_ms(lambda: combine.sum_k(y, K_TOP), reps=5, warmup=1)}
    log(f"memory passes: {res}")
    return res


def sweep(block, x, dy):
    """Each expert GEMM alone under each config; the winners become the autotuner's candidates."""
    table, best = {}, {}
    cases, tensors = _gemm_cases(block, x, dy)
    for name, (flops, call) in cases.items():
        configs = WGRAD_CONFIGS if name.startswith("wgrad") else GEMM_CONFIGS
        for c in configs[:1] if name.endswith("torch_grouped_mm") else configs:
            # torch._grouped_mm takes no config: its rows carry the name alone
            label = name if name.endswith("torch_grouped_mm") else f"{name} " + " ".join(f"{k}={v}" for k, v in c.items())
            try:
                ms = time_ms(lambda: call(c), reps=5, warmup=1)
            except Exception as error:  # a config that does not fit is reported, not fatal
                log(f"{label}: FAILED {type(error).__name__}: {str(error)[:120]}")
                continue
            table[label] = dict(ms=ms, tflops=flops / ms / 1e9)
            log(f"{label}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
            if name.endswith("torch_grouped_mm"):
                continue
            if name not in best or ms < best[name][0]:
                best[name] = (ms, c)
    _apply(best)
    return {"table": table, "best": {n: dict(ms=ms, config=c) for n, (ms, c) in best.items()},
            "memory_passes": _memory_passes(**tensors)}


def _apply(best):
    """Autotune among the per-GEMM winners (the autotuner keys on the row layout too)."""
    kernel_experts._block_m = lambda rows, experts: BLOCK_M
    as_config = lambda c: triton.Config({k: v for k, v in c.items() if k.isupper()}, num_warps=c["num_warps"], num_stages=c["num_stages"])  # noqa: E731
    gg._tuned_kernel.configs = _unique([as_config(c) for n, (_, c) in best.items() if not n.startswith("wgrad")])
    gw._tuned_kernel.configs = _unique([as_config(c) for n, (_, c) in best.items() if n.startswith("wgrad")])
    gg._tuned_kernel.cache.clear()
    gg.CHOSEN_CONFIGS.clear()
    gw._tuned_kernel.cache.clear()
    log(f"gemm configs {[str(c) for c in gg._tuned_kernel.configs]}; wgrad configs {[str(c) for c in gw._tuned_kernel.configs]}")


def _unique(configs):
    seen = {}
    for c in configs:
        seen.setdefault(str(c), c)
    return list(seen.values())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, default=16384)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sweep", action="store_true", help="time each expert GEMM under each config first and "
                        "autotune among the winners (else the kernels' own configs, winners of an earlier sweep)")
    args = parser.parse_args()
    block = build_block()
    g = torch.Generator(device=DEVICE).manual_seed(2)
    x = torch.randn(args.T, D, device=DEVICE, dtype=torch.bfloat16, generator=g).requires_grad_()
    dy = torch.randn(args.T, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    result = {"name": "moe", "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "date": str(datetime.date.today()),
              "shape": f"T{args.T} D{D} E{E} k{K_TOP} F{F_EXPERT} shared{F_SHARED} bf16",
              "baseline": "transformers Qwen3NextSparseMoeBlock, experts_implementation=grouped_mm, fwd+bwd w.r.t. input and all weights",
              "command": "PYTHONUNBUFFERED=1 python bench/bench_moe.py --out $OUT" + (" --sweep" if args.sweep else ""),
              "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                           "triton": __import__("triton").__version__}}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "moe.json")
    stages = (timings, variant_timings, correctness, frozen_timings, lora_variant_timings, profile, hf_graph)
    for stage in ((sweep,) if args.sweep else ()) + stages:
        try:
            result[stage.__name__] = stage(block, x, dy)
        except Exception as error:  # one failing stage is reported, the others still run
            result[stage.__name__] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            log(f"{stage.__name__} FAILED: {result[stage.__name__]['error']}")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    summarize(result)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def summarize(result):
    t = result.get("timings", {})
    if "hf_fwd_bwd" in t:
        result |= {"baseline_ms": t["hf_fwd_bwd"], "ours_ms": t["ours_fwd_bwd"], "speedup": t["hf_fwd_bwd"] / t["ours_fwd_bwd"]}
    frozen = result.get("frozen_timings", {})
    if "hf_frozen_fwd_bwd" in frozen:
        result["frozen_speedup"] = frozen["hf_frozen_fwd_bwd"] / frozen["ours_frozen_fwd_bwd"]
    errs = [v["rel_rms"] for k, group in result.get("correctness", {}).items()
            if k in ("full", "lora_frozen_base", "shared_expert") for v in group.values()]
    if errs:
        result["max_rel_err"] = max(errs)
    print("\n| what | ms |\n|---|---|")
    for stage in ("timings", "frozen_timings"):
        for name, ms in result.get(stage, {}).items():
            if isinstance(ms, float):
                print(f"| {name} | {ms:.2f} |")
    variants = result.get("variant_timings", {}).get("ms", {})
    if variants:
        result["variant_speedups"] = result["variant_timings"]["speedup_vs_transformers"]
        print("\n| variant (same rounds) | fwd+bwd ms | x transformers |\n|---|---|---|")
        for name, ms in variants.items():
            print(f"| {name} | {ms:.2f} | {variants['transformers'] / ms:.3f} |")
    print({k: result.get(k) for k in ("baseline_ms", "ours_ms", "speedup", "frozen_speedup", "max_rel_err")})
    sys.stdout.flush()


if __name__ == "__main__":
    main()
