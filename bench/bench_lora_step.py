"""LoRA training step on the Qwen3-Next-width 4-layer slice of ../shared/TARGETS.md: ours vs transformers + PEFT.

One release is written by transformers (random init, bf16, save_pretrained) and onboarded with `onboard new-model`;
every contender then trains from those same weights, each in its own process (clean peak memory; fla importable or
not): transformers + PEFT with fla's kernels (the peer to beat), the same on transformers' torch path, and our runtime
through the package. Each step: forward, loss, backward, AdamW on the LoRA parameters; 3 warm-up steps, then 3 s of
steps to bring the GPU to its sustained clocks, then the mean of 10 (the mean of 10 straight after the warm-up is kept
as `fresh_seconds`).
Parts: `attention` LoRA (r16 alpha32 on the attention and linear-attention projections), `experts` (also the routed
experts: PEFT `target_parameters`), `longest` (the longest power-of-two sequence one step trains under each memory
policy), `profile` (our step's GPU time per op kind). MFU: runtime/train/flops.py's count over 790 TFLOP/s.

    python bench/bench_lora_step.py --out $OUT [--parts attention,experts,longest,profile]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
RANK, ALPHA = 16, 32
PEAK_TFLOPS = 790.0
WARMUP, REPS = 3, 10
# seconds of untimed steps before the timed ones (bench.timing.settle)
SETTLE_S = 3.0
DEVICE = "cuda"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def slice_config():
    from transformers import Qwen3NextConfig
    return Qwen3NextConfig(num_hidden_layers=4, layer_types=3 * ["linear_attention"] + ["full_attention"])


def prepare(work: Path) -> None:
    """The release (transformers' init, bf16 shards) and its package (what `onboard new-model` writes)."""
    import torch
    from transformers import Qwen3NextForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3NextForCausalLM(slice_config()).to(torch.bfloat16)
    model.save_pretrained(work / "release", max_shard_size="4GB")
    del model
    # the package writer alone: new-model would also align the full-width slice against transformers on the CPU
    from onboard.package.writer import write_package
    write_package(work / "release", work / "pkg")


def token_batch(seq_len: int, vocab: int):
    import torch
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (1, seq_len), generator=generator).to(DEVICE)


def timed_steps(step, peak_from_start: bool = False) -> dict:
    """seconds: mean s/step over REPS once SETTLE_S seconds of steps after the WARMUP ones have brought the GPU to
    its sustained clocks, as a trainer's steps run; fresh_seconds: the mean of REPS straight after the warm-up, at
    the clocks of a GPU that was idle; first_loss; peak_gib after the warm-up, or from the first step on (a graph's
    capture allocates its private pool once, and replays then allocate nothing the peak would see)."""
    import torch
    from bench.timing import settle
    torch.cuda.reset_peak_memory_stats()
    first = float(step())
    for _ in range(WARMUP - 1):
        step()
    torch.cuda.synchronize()
    if not peak_from_start:
        torch.cuda.reset_peak_memory_stats()

    def mean_seconds() -> float:
        start = time.perf_counter()
        for _ in range(REPS):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / REPS

    fresh = mean_seconds()
    settle(step, SETTLE_S, calls_per_sync=4)
    return dict(seconds=mean_seconds() if SETTLE_S else fresh, fresh_seconds=fresh, first_loss=first,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30)


def peft_part(work: Path, experts: bool, fla: bool, seq_len: int) -> dict:
    import torch
    if fla:
        import fla.ops.common.chunk_o as chunk_o
        # fla refuses its gated backward on Hopper with triton < 3.7.1 (fla issue 640); bypassed to time the
        # baseline only, as TARGETS.md says
        chunk_o.TRITON_ABOVE_3_7_1 = True
    else:
        sys.modules["fla"] = None  # transformers then takes its torch path
    import peft
    from transformers import Qwen3NextForCausalLM
    model = Qwen3NextForCausalLM.from_pretrained(work / "release", dtype=torch.bfloat16, device_map="cuda",
                                                 attn_implementation="sdpa", trust_remote_code=False)
    extra = dict(target_parameters=EXPERT_PARAMETERS) if experts else {}
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=ATTENTION_TARGETS,
                                                       **extra))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ids = token_batch(seq_len, model.config.vocab_size)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return timed_steps(step) | dict(trainable=sum(p.numel() for p in params))


# --policy names -> the memory policies they stand for (runtime/memory.py)
POLICIES = {"none": {}, "recompute": dict(recompute=("attention", "linear_attention", "moe", "mlp")),
            "recompute_offload": dict(recompute=("linear_attention", "moe", "mlp"), offload=("attention",))}


def ours_setup(work: Path, experts: bool, seq_len: int, policy: str | None = None):
    """(steps, model, trainable params): the package's model as `onboard train` builds it (LoRA r16 alpha32 on the
    package's attention targets, the experts too when asked), one packed row of seq_len tokens, the chunked loss;
    steps[graph] is the trainer's step, its forward+backward replayed as a CUDA graph or run eagerly. Run the eager
    one first: the graphed one keeps its .grad tensors for good."""
    import dataclasses
    import json as json_

    import torch
    from onboard.package.trainer_build import build_model, read_lora
    from runtime.memory import MemoryPolicy
    from runtime.train.data import Document, pack
    from runtime.train.loop import TrainConfig, micro_batch, micro_step_for, optimizer_for
    spec, weight_map = (json_.loads((work / "pkg" / name).read_text()) for name in ("spec.json", "weight_map.json"))
    lora = dataclasses.replace(read_lora(work / "pkg", weight_map), rank=RANK, alpha=ALPHA, experts=experts)
    model = build_model(spec, weight_map, work / "release", lora, MemoryPolicy(**POLICIES[policy or "none"]), DEVICE)
    params = [p for p in model.parameters() if p.requires_grad]
    device = torch.device(DEVICE)
    # the trainer's own pieces (runtime/train/loop.py): its fused AdamW and its micro-step
    cfg = TrainConfig(lr=1e-4)
    optimizer = optimizer_for(params, cfg, device)
    ids = token_batch(seq_len, model.config.vocab_size)
    batch = micro_batch(pack([Document(ids[0].tolist(), [True] * seq_len)], seq_len, 0), [0], device)
    scale = torch.tensor(1 / (seq_len - 1), device=device)

    def step_of(micro_step):
        def step():
            loss = micro_step(batch, scale)
            optimizer.step()
            optimizer.zero_grad(set_to_none=not micro_step.keeps_grads)
            return loss
        step.micro_step = micro_step
        return step

    steps = {graph: step_of(micro_step_for(model, params, dataclasses.replace(cfg, cuda_graph=graph), device,
                                           model.offloads_activations)) for graph in (False, True)}
    return steps, model, params


def ours_part(work: Path, experts: bool, seq_len: int, policy: str | None = None, graph: bool = True) -> dict:
    """Our step timed eagerly, then graphed (the trainer's default) unless graph is False."""
    from runtime.train.flops import step_flops
    steps, model, params = ours_setup(work, experts, seq_len, policy)
    eager = timed_steps(steps[False])
    flops = step_flops(model, [seq_len])
    result = eager | dict(trainable=sum(p.numel() for p in params), flops=flops,
                          mfu=flops / eager["seconds"] / (PEAK_TFLOPS * 1e12), cuda_graph="not timed")
    if graph:
        graphed = timed_steps(steps[True], peak_from_start=True)
        result |= dict(seconds=graphed["seconds"], fresh_seconds=graphed["fresh_seconds"],
                       peak_gib=max(eager["peak_gib"], graphed["peak_gib"]),
                       mfu=flops / graphed["seconds"] / (PEAK_TFLOPS * 1e12), eager_seconds=eager["seconds"],
                       eager_peak_gib=eager["peak_gib"], cuda_graph=steps[True].micro_step.reason or "on")
    return result


def profile_part(work: Path, seq_len: int) -> dict:
    """Our step's GPU time per kernel and op kind (eager), and the graphed step's total GPU time."""
    from bench.timing import kernel_ms
    from runtime.train.profile_kinds import op_kind
    steps, _, _ = ours_setup(work, False, seq_len)
    per_kernel = kernel_ms(steps[False], warmup=3)
    graphed = kernel_ms(steps[True], warmup=3)
    kinds = {}
    for name, ms in per_kernel.items():
        kinds[op_kind(name)] = kinds.get(op_kind(name), 0.0) + ms
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:40]
    return dict(gpu_ms_per_step=sum(per_kernel.values()), graphed_gpu_ms_per_step=sum(graphed.values()),
                ops=dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
                top_kernels=[dict(name=n[:160], ms=round(ms, 4), kind=op_kind(n)) for n, ms in top])


def in_subprocess(args: list[str], timeout: int = 400) -> dict:
    """Run one part in a fresh process; its JSON result, or the error it ended with."""
    result = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout)
    sys.stderr.write(result.stderr[-3000:])
    if result.returncode != 0:
        return dict(error=(result.stderr.strip().splitlines() or ["exit %d" % result.returncode])[-1])
    return json.loads(result.stdout.strip().splitlines()[-1])


def compare(work: Path, experts: bool, seq_len: int = 4096) -> dict:
    flag = ["--experts"] if experts else []
    common = ["--work", str(work), "--seq-len", str(seq_len), *flag]
    peers = {name: in_subprocess(["--part", name, *common]) for name in ("peft_fla", "peft_torch", "ours")}
    ours, fla, torch_path = peers["ours"], peers["peft_fla"], peers["peft_torch"]
    tokens = lambda r: seq_len / r["seconds"] if "seconds" in r else None  # noqa: E731
    result = dict(peers=peers, tokens_per_s=tokens(ours), baseline_tokens_per_s=tokens(fla),
                  torch_path_tokens_per_s=tokens(torch_path))
    if "seconds" in ours and "seconds" in fla:
        result.update(baseline_ms=fla["seconds"] * 1e3, ours_ms=ours["seconds"] * 1e3,
                      speedup=fla["seconds"] / ours["seconds"],
                      fresh_speedup=fla["fresh_seconds"] / ours["fresh_seconds"], peak_mem_gib=ours["peak_gib"],
                      baseline_peak_mem_gib=fla["peak_gib"], mfu=ours["mfu"],
                      max_rel_err=abs(ours["first_loss"] - fla["first_loss"]) / abs(fla["first_loss"]))
    return result


def longest(work: Path, policies: dict[str, int]) -> dict:
    """Per policy, the longest power-of-two sequence (from its start length up to 262144) one step trains."""
    found = {}
    for policy, start in policies.items():
        found[policy] = {"longest_seq": None, "tried": {}}
        seq_len = start
        while seq_len <= 262144:
            r = in_subprocess(["--part", "ours", "--work", str(work), "--seq-len", str(seq_len), "--policy", policy,
                               "--one-step"])
            found[policy]["tried"][seq_len] = r
            if "error" in r:
                break
            found[policy]["longest_seq"] = seq_len
            seq_len *= 2
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--parts", default="attention,experts,longest,profile")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lora-slice"))
    parser.add_argument("--part")
    parser.add_argument("--experts", action="store_true")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--policy")
    parser.add_argument("--one-step", action="store_true")
    args = parser.parse_args()
    if args.part:
        print(json.dumps(run_part(args)))
        return
    run_all(args)


def run_part(args) -> dict:
    global WARMUP, REPS, SETTLE_S
    if args.one_step:
        WARMUP, REPS, SETTLE_S = 1, 1, 0.0
    if args.part == "ours":
        # the longest-sequence search (one step per length) asks what the eager step's memory allows
        return ours_part(args.work, args.experts, args.seq_len, args.policy, graph=not args.one_step)
    if args.part == "profile":
        return profile_part(args.work, args.seq_len)
    return peft_part(args.work, args.experts, args.part == "peft_fla", args.seq_len)


def run_all(args) -> None:
    import torch
    parts = args.parts.split(",")
    if not (args.work / "pkg").exists():
        log("writing the slice release and its package")
        prepare(args.work)
    base = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                shape="Qwen3-Next widths, 4 layers (3 GDN + 1 full attention), 512 experts top-10, seq 4096, batch 1",
                baseline="transformers + PEFT with fla 0.6.0's kernels (sdpa)",
                command="python bench/bench_lora_step.py --out $OUT --parts " + args.parts)
    # each result is written as soon as it exists: a run stopped by a time limit keeps the parts it finished
    write = functools.partial(write_result, args.out)
    if "attention" in parts:
        write("lora-step", dict(base, name="lora-step", **compare(args.work, experts=False)))
    if "profile" in parts:
        write("lora-step-profile", dict(base, name="lora-step-profile",
                                        **in_subprocess(["--part", "profile", "--work", str(args.work)])))
    if "experts" in parts:
        write("lora-step-experts", dict(base, name="lora-step-experts", **compare(args.work, experts=True)))
    if "longest" in parts:
        # start lengths: each process loads the 14 GB slice, so the search skips what TARGETS.md says trains
        found = longest(args.work, {"none": 32768, "recompute": 65536})
        best = max((f["longest_seq"] or 0, p) for p, f in found.items())
        write("longest-seq", dict(base, name="longest-seq", longest_seq=best[0], policy=best[1], policies=found))


def write_result(out: Path | None, name: str, result: dict) -> None:
    log(json.dumps({k: v for k, v in result.items() if k not in ("peers", "policies", "ops")}))
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
