"""Frozen bases kept in their released format (issue 50): the MoE block and the FP8 projections of two real-width
4-layer slices, trained with LoRA on a stored base vs the same base held in bf16, one GPU.

Slices (the widths of the released configs):
- gpt-oss-120b: hidden 2880, 128 experts top-4, expert width 2880, MXFP4 experts (the release's only quantized
  weights), the gpt-oss GLU (clamp 7, alpha 1.702, interleaved gate/up, expert biases), top-4-then-softmax router.
- deepseek-v3: hidden 7168, 256 experts top-8, expert width 2048, FP8 e4m3 with 128x128 block scales, sigmoid router
  with 8 groups (top 4), correction bias, routed scaling 2.5; and its MLA projections (FP8 in the release: q_a 1536x7168,
  q_b 24576x1536, kv_a 576x7168, kv_b 32768x512, o 7168x16384), each with its own input (the attention core between
  them is the same in every variant and left out).

A step is forward and backward of `--layers` such blocks (x + experts(x), routed by the block's frozen router) over
`--tokens` tokens, LoRA r16 on both expert projections (and on every projection), base frozen: gradients reach the
input and the LoRA factors. Variants, each with only its own weights on the GPU:
- stored: codes and scales as released; the grouped GEMMs (and stored_linear) decode tiles in registers.
- bf16: the base decoded once and held in bf16, the same fused kernels (bf16 GEMMs; for projections F.linear).
- dequantize: each step decodes every layer's whole weight to bf16, then the same bf16 kernels, the decoded weights
  kept for the backward as autograd keeps any GEMM input (the "dequantize then bf16" path; transformers'
  `dequantize=True` decodes once at load instead, whose memory and speed are the bf16 row's with its own kernels).
- torch (opt-in, `--variants`): the stored torch form (decode per layer, re-decode in backward).
A variant that does not fit at `--layers` runs again at one layer and says so (`layers_run`).
Correctness first, at the slice widths on a small batch (8 experts, 128 tokens): the fused path in bf16 against the
torch form in fp32 on the same stored bytes, output and every gradient (runtime/tolerances.py bf16 bars), recorded.

    python bench/bench_stored_formats.py --out DIR        # JSON: DIR/stored-formats.json ($OUT when --out is absent)
    python bench/bench_stored_formats.py --tiny --out DIR # the CPU path at tiny widths (torch forms)

Shape legend: T tokens, D hidden, E experts, F expert width, k top-k, O/I a projection's out/in widths, r rank.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime import dispatch  # noqa: E402
from runtime.ops.common.backend import force  # noqa: E402
from runtime.ops.common.launch import interpreting  # noqa: E402
from runtime.ops.moe import torch_form as moe_torch  # noqa: E402
from runtime.ops.stored_matmul import torch_form as stored_torch  # noqa: E402
from runtime.tolerances import compare, tolerance_for  # noqa: E402

RANK, LORA_SCALE = 16, 2.0
# experts decoded at a time when a whole layer is decoded (the codec's fp32 intermediate of one layer's DeepSeek
# gate/up would be 30 GB)
DECODE_CHUNK = 16


@dataclass(frozen=True)
class Slice:
    hidden: int
    num_experts: int
    top_k: int
    width: int
    kind: str
    block: tuple[int, int] | None
    glu: dict = field(default_factory=dict)
    expert_bias: bool = False
    router: dict = field(default_factory=dict)
    correction_bias: bool = False
    projections: dict = field(default_factory=dict)  # name -> (O, I), stored in the release's format


SLICES = {
    "gpt-oss-120b": Slice(2880, 128, 4, 2880, "mxfp4", None, dict(clamp=7.0, glu_alpha=1.702, interleaved_gate_up=True),
                          expert_bias=True, router=dict(norm_topk_prob=False, topk_before_softmax=True)),
    "deepseek-v3": Slice(7168, 256, 8, 2048, "fp8_block", (128, 128),
                         router=dict(scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, num_groups=8,
                                     topk_groups=4), correction_bias=True,
                         projections={"q_a_proj": (1536, 7168), "q_b_proj": (24576, 1536),
                                      "kv_a_proj_with_mqa": (576, 7168), "kv_b_proj": (32768, 512),
                                      "o_proj": (7168, 16384)}),
}


def tiny(s: Slice) -> Slice:
    """The slice at widths the CPU runs in seconds (the same formats, router and GLU)."""
    projections = {name: (max(o // 256, 64), max(i // 256, 64)) for name, (o, i) in s.projections.items()}
    return replace(s, hidden=64, num_experts=16, width=32, block=(32, 32) if s.block else None,
                   projections=projections)


# --- stored weights: random codes and scales in the release's format (valid stored weights, made on the device)

def random_stored(E: int, O: int, I: int, s: Slice, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of E stacked [O, I] weights whose decoded values have RMS about I^-0.5."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if s.kind == "mxfp4":
        codes = torch.randint(0, 256, (E, O, I // 2), dtype=torch.uint8, device=device, generator=gen)
        # uniform e2m1 codes have RMS about 3.3
        exponent = 127 + round(math.log2(I ** -0.5 / 3.3))
        scale = torch.randint(exponent - 1, exponent + 2, (E, O, I // 32), dtype=torch.uint8, device=device,
                              generator=gen)
        return codes, scale
    b0, b1 = s.block
    codes = torch.empty(E, O, I, dtype=torch.float8_e4m3fn, device=device)
    for e in range(E):
        codes[e] = (torch.randn(O, I, device=device, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (E, -(-O // b0), -(-I // b1))
    scale = (0.5 + torch.rand(grid, device=device, generator=gen)) * (I ** -0.5 / 64)
    return codes, scale


def decode_bf16(codes: torch.Tensor, scale: torch.Tensor, s: Slice) -> torch.Tensor:
    """The whole stacked weight in bf16, decoded DECODE_CHUNK experts at a time."""
    parts = [stored_torch.decode(codes[e:e + DECODE_CHUNK], scale[e:e + DECODE_CHUNK], s.kind, s.block, torch.bfloat16)
             for e in range(0, codes.shape[0], DECODE_CHUNK)]
    return torch.cat(parts)


@dataclass
class Layer:
    router_w: torch.Tensor
    correction: torch.Tensor | None
    gate_up: tuple  # (codes, scale) or (bf16 weight,)
    down: tuple
    biases: dict
    lora: dict
    projections: dict  # name -> (codes, scale) or (bf16 weight,), with its LoRA pair


def make_layer(s: Slice, index: int, variant: str, device, dtype, num_experts: int | None = None) -> Layer:
    E, D, Fw = num_experts or s.num_experts, s.hidden, s.width
    gen = torch.Generator(device=device).manual_seed(1000 + index)

    def rand(*shape, std=1.0, dt=dtype):
        return (torch.randn(shape, device=device, generator=gen) * std).to(dt)

    def base(E_, O, I, seed):
        codes, scale = random_stored(E_, O, I, s, seed, device)
        if variant == "bf16":
            return (decode_bf16(codes, scale, s).to(dtype),)
        return codes, scale

    lora = dict(lora_gate_up=(rand(E, RANK, D, std=D ** -0.5, dt=torch.float32).requires_grad_(),
                              rand(E, 2 * Fw, RANK, std=0.01, dt=torch.float32).requires_grad_()),
                lora_down=(rand(E, RANK, Fw, std=Fw ** -0.5, dt=torch.float32).requires_grad_(),
                           rand(E, D, RANK, std=0.01, dt=torch.float32).requires_grad_()))
    biases = dict(b_gate_up_E2F=rand(E, 2 * Fw, std=0.01), b_down_ED=rand(E, D, std=0.01)) if s.expert_bias else {}
    projections = {}
    for j, (name, (O, I)) in enumerate(s.projections.items()):
        weight = base(1, O, I, 100 * index + 50 + j)
        projections[name] = ([w[0] for w in weight], (rand(RANK, I, std=I ** -0.5, dt=torch.float32).requires_grad_(),
                                                      rand(O, RANK, std=0.01, dt=torch.float32).requires_grad_()))
    return Layer(rand(E, D, std=D ** -0.5), rand(E, std=0.01, dt=torch.float32) if s.correction_bias else None,
                 base(E, 2 * Fw, D, 100 * index), base(E, D, Fw, 100 * index + 1), biases, lora, projections)


# --- one block's forward under each variant

def experts_call(layer: Layer, s: Slice, variant: str, x_TD, weights_Tk, idx_Tk):
    lora = {name: tuple(f.to(x_TD.dtype) for f in pair) for name, pair in layer.lora.items()}
    kwargs = dict(**layer.biases, **s.glu, **lora, lora_scale=LORA_SCALE)
    if variant == "bf16":
        return dispatch.op("moe_experts", x_TD.device)(x_TD, weights_Tk, idx_Tk, *layer.gate_up, *layer.down, **kwargs)
    if variant == "dequantize":
        w_gu, w_d = decode_bf16(*layer.gate_up, s).to(x_TD.dtype), decode_bf16(*layer.down, s).to(x_TD.dtype)
        return dispatch.op("moe_experts", x_TD.device)(x_TD, weights_Tk, idx_Tk, w_gu, w_d, **kwargs)
    fn = moe_torch.stored_swiglu_experts if variant == "torch" else dispatch.op("moe_experts_stored", x_TD.device)
    return fn(x_TD, weights_Tk, idx_Tk, *layer.gate_up, *layer.down, kind=s.kind, block=s.block, **kwargs)


def block(layer: Layer, s: Slice, variant: str, x_TD):
    logits = moe_torch.router_logits(x_TD, layer.router_w)
    weights_Tk, idx_Tk = dispatch.op("moe_router", x_TD.device)(logits, s.top_k, correction_bias_E=layer.correction,
                                                                 **s.router)
    return x_TD + experts_call(layer, s, variant, x_TD, weights_Tk, idx_Tk)


def projection(weight: list, lora: tuple, s: Slice, variant: str, x_TI):
    A, B = (f.to(x_TI.dtype) for f in lora)
    if variant in ("bf16", "dequantize"):
        w = weight[0] if variant == "bf16" else decode_bf16(weight[0][None], weight[1][None], s)[0].to(x_TI.dtype)
        return F.linear(x_TI, w) + LORA_SCALE * (x_TI @ A.T) @ B.T
    fn = stored_torch.stored_linear if variant == "torch" else dispatch.op("stored_linear", x_TI.device)
    return fn(x_TI, weight[0], weight[1], kind=s.kind, block=s.block, lora=(A, B), lora_scale=LORA_SCALE)


def step_fn(layers: list[Layer], s: Slice, variant: str, T: int, part: str, device, dtype):
    gen = torch.Generator(device=device).manual_seed(7)
    if part == "experts":
        x0 = torch.randn(T, s.hidden, device=device, generator=gen).to(dtype)

        def step():
            x = x0.detach().requires_grad_()
            h = x
            for layer in layers:
                h = block(layer, s, variant, h)
            h.float().square().mean().backward()
        return step
    inputs = {name: torch.randn(T, I, device=device, generator=gen).to(dtype) for name, (O, I) in s.projections.items()}

    def step():
        total = 0.0
        for layer in layers:
            for name, (weight, lora) in layer.projections.items():
                total = total + projection(weight, lora, s, variant, inputs[name].detach().requires_grad_()).float().square().mean()
        total.backward()
    return step


# --- correctness: fused (bf16 on CUDA, fp32 under the interpreter) vs the torch form in fp32, same stored bytes

def _grads_of(fn, leaves: dict, cot_seed: int):
    out = fn({n: t.detach().clone().requires_grad_() for n, t in leaves.items()})
    y, inputs = out
    gen = torch.Generator(device=y.device).manual_seed(cot_seed)
    (y.float() * torch.randn(y.shape, device=y.device, generator=gen)).sum().backward()
    return y.detach().float(), {n: t.grad.float() for n, t in inputs.items()}


def _compare_all(name, ours, truth, op, dtype) -> dict:
    (y, grads), (y_ref, grads_ref) = ours, truth
    results = {f"{name}/out": compare(y, y_ref, tolerance_for(op, dtype, "out"))}
    results |= {f"{name}/grad:{n}": compare(grads[n], grads_ref[n], tolerance_for(op, dtype, "grad")) for n in grads}
    return {k: dict(rel_rms=c.rel_rms, max_abs_rel=c.max_abs_rel, tolerance=c.tolerance.rel_rms, passed=c.passed)
            for k, c in results.items()}


def fused_backend(device) -> str | None:
    """The backend the correctness check's fused side runs: the selector's own on CUDA, the Triton kernels under the
    interpreter, else (nothing fused can run) the torch form, which the JSON then says."""
    if device.type == "cuda":
        return None
    return "triton" if interpreting() else "torch"


def check_experts(s: Slice, device, dtype, T: int, E: int = 8) -> dict:
    layer = make_layer(s, 0, "stored", device, torch.float32, num_experts=E)
    gen = torch.Generator(device=device).manual_seed(3)
    idx = torch.stack([torch.randperm(E, device=device, generator=gen)[:s.top_k] for _ in range(T)])
    leaves = {"x": torch.randn(T, s.hidden, device=device, generator=gen), "weights": torch.rand(T, s.top_k, device=device, generator=gen),
              "A_gu": layer.lora["lora_gate_up"][0].detach(), "B_gu": layer.lora["lora_gate_up"][1].detach() * 30,
              "A_d": layer.lora["lora_down"][0].detach(), "B_d": layer.lora["lora_down"][1].detach() * 30}

    def run(fn, dt):
        def call(a):
            y = fn(a["x"].to(dt), a["weights"], idx, *layer.gate_up, *layer.down, kind=s.kind, block=s.block,
                   **{k: v.to(dt) for k, v in layer.biases.items()}, **s.glu, lora_scale=LORA_SCALE,
                   lora_gate_up=(a["A_gu"].to(dt), a["B_gu"].to(dt)), lora_down=(a["A_d"].to(dt), a["B_d"].to(dt)))
            return y, a
        return call

    fused = _grads_of(run(dispatch.op("moe_experts_stored", device), dtype), leaves, 5)
    truth = _grads_of(run(moe_torch.stored_swiglu_experts, torch.float32), leaves, 5)
    return _compare_all("experts", fused, truth, "moe_experts_stored", dtype)


def check_projections(s: Slice, device, dtype, T: int) -> dict:
    layer = make_layer(replace(s, num_experts=1), 0, "stored", device, torch.float32)
    results = {}
    for name, (weight, (A, B)) in layer.projections.items():
        gen = torch.Generator(device=device).manual_seed(4)
        leaves = {"x": torch.randn(T, A.shape[1], device=device, generator=gen), "A": A.detach(), "B": B.detach() * 30}

        def run(fn, dt):
            def call(a):
                return fn(a["x"].to(dt), weight[0], weight[1], kind=s.kind, block=s.block,
                          lora=(a["A"].to(dt), a["B"].to(dt)), lora_scale=LORA_SCALE), a
            return call

        fused = _grads_of(run(dispatch.op("stored_linear", device), dtype), leaves, 6)
        truth = _grads_of(run(stored_torch.stored_linear, torch.float32), leaves, 6)
        results |= _compare_all(name, fused, truth, "stored_linear", dtype)
    return results


# --- timing

def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _time_ms(step, device, reps: int) -> float:
    if device.type == "cuda":
        from bench.timing import time_ms

        return time_ms(step, reps=reps, warmup=2)
    step()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    return (time.perf_counter() - start) / reps * 1e3


def measure(s: Slice, variant: str, part: str, layers: int, T: int, device, dtype, reps: int) -> dict:
    """ms a step, tokens/s and peak GiB of one variant at `layers` layers (again at one layer if it does not fit)."""
    for num_layers in dict.fromkeys((layers, 1)):
        built = step = None
        try:
            built = [make_layer(s, i, variant, device, dtype) for i in range(num_layers)]
            step = step_fn(built, s, variant, T, part, device, dtype)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            ms = _time_ms(step, device, reps)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
            return dict(layers_run=num_layers, fits=num_layers == layers, ms=ms, ms_per_layer=ms / num_layers,
                        tokens_per_s=T / ms * 1e3 * num_layers / layers, peak_gib=peak)
        except torch.OutOfMemoryError as error:
            oom = str(error).splitlines()[0]
        finally:
            # the step's closure holds the layers too: both go before a retry at one layer
            built = step = None
            _free()
    return dict(layers_run=0, fits=False, error=oom)


def run_slice(name: str, s: Slice, args, device, dtype) -> dict:
    result = dict(widths=dict(hidden=s.hidden, experts=s.num_experts, top_k=s.top_k, expert_width=s.width,
                              format=s.kind, block=s.block, projections=s.projections))
    # a small batch: 128 tokens on the GPU, fewer under the interpreter
    T = 128 if device.type == "cuda" else 24
    with force(fused_backend(device)):
        checks = check_experts(s, device, dtype, T)
        if s.projections:
            checks |= check_projections(s, device, dtype, T)
    result["correctness"] = checks
    result["fused_backend"] = fused_backend(device) or "selector (CUDA)"
    result["correct"] = all(c["passed"] for c in checks.values())
    for part in ("experts", "projections") if s.projections else ("experts",):
        result[part] = {v: measure(s, v, part, args.layers, args.tokens, device, dtype, args.reps)
                        for v in args.variants.split(",")}
        stored = result[part].get("stored", {})
        for base in ("bf16", "dequantize"):
            other = result[part].get(base, {})
            if stored.get("ms_per_layer") and other.get("ms_per_layer"):
                stored[f"speed_vs_{base}"] = other["ms_per_layer"] / stored["ms_per_layer"]
                if stored.get("peak_gib") and other.get("peak_gib") and stored["fits"] and other["fits"]:
                    stored[f"peak_vs_{base}"] = stored["peak_gib"] / other["peak_gib"]
    return result


def _table(results: dict) -> str:
    lines = [f"{'slice/part':34} {'variant':11} {'layers':>6} {'ms/step':>9} {'tokens/s':>10} {'peak GiB':>9}"]
    for name, r in results["slices"].items():
        verdict = "ok" if r["correct"] else "FAIL"
        worst = max(c["rel_rms"] for c in r["correctness"].values())
        lines.append(f"{name}: fused vs torch form {verdict} (worst rel RMS {worst:.2e})")
        for part in ("experts", "projections"):
            for variant, m in r.get(part, {}).items():
                if not m.get("layers_run"):
                    lines.append(f"{name + '/' + part:34} {variant:11} {'-':>6} out of memory")
                    continue
                peak = f"{m['peak_gib']:.2f}" if m["peak_gib"] is not None else "-"
                lines.append(f"{name + '/' + part:34} {variant:11} {m['layers_run']:>6} {m['ms']:>9.2f} "
                             f"{m['tokens_per_s']:>10.0f} {peak:>9}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    parser.add_argument("--slices", default=",".join(SLICES))
    parser.add_argument("--variants", default="stored,bf16,dequantize")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="tiny widths: the CPU path (torch forms) in seconds")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    # bf16 on the GPU; fp32 on the CPU (the interpreter's bf16 dots are wrong, and the CPU runs the torch forms)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        args.tokens, args.reps = min(args.tokens, 64), 1
    results = dict(
        command="python bench/bench_stored_formats.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        torch=torch.__version__, triton=_triton_version(), tokens=args.tokens, layers=args.layers, lora_rank=RANK,
        dtype=str(dtype).removeprefix("torch."), slices={})
    for name in args.slices.split(","):
        s = tiny(SLICES[name]) if args.tiny else SLICES[name]
        results["slices"][name] = run_slice(name, s, args, device, dtype)
        print(_table(dict(slices={name: results["slices"][name]})), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / ("stored-formats-tiny.json" if args.tiny else "stored-formats.json")).write_text(
            json.dumps(results, indent=1))
    return results


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    main()
