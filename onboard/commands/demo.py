"""`onboard demo [--out DIR] [--steps N] [--force]`: the whole loop on a tiny hybrid MoE, on CPU.

Each stage is the command a user would type, printed and then run in this process: `example-model
qwen3_next` (3 gated-delta + 1 softmax layer, 8 experts top-2, its small real BPE tokenizer),
`new-model` (the onboarding graph: package, alignment tiers 0-2), `train` on onboard/data/demo_text.jsonl
(short prose written for this project), `export --peft`. Then the adapter is loaded by transformers + peft
and its logits compared with our runtime's under the same trained LoRA (tier 2's fp32 logits bar), beside
how far the adapter moved the logits from the base model's, so the equality is not that of two no-ops.
DIR (default ./onboard-demo) must be new or empty; --force replaces one an earlier demo wrote (it holds
MARKER), never another folder. One intra-op thread: at these widths threads gain nothing, and on a busy
machine their spin-waits made a step 10-40x slower (bench/NOTES.md).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import onboard
from onboard.commands.args import positive_int
from onboard.errors import BadInput
from onboard.exit_codes import Exit

# onboard/data/ found by the package, not by this file's place, so the module can move
DATA = Path(onboard.__file__).resolve().parent / "data" / "demo_text.jsonl"
FAMILY = "qwen3_next"
SEQ_LEN = 128
# the tiny model's LoRA needs a larger step than a real model's 1e-4 to show its loss falling in 30 steps
LR = "1e-2"
MARKER = ".onboard-demo"
SAMPLE = "A small adapter, trained for a few steps, changes what the model expects to read next."


@dataclass(frozen=True)
class Paths:
    out: Path

    @property
    def release(self) -> Path:
        return self.out / "release"

    @property
    def package(self) -> Path:
        return self.out / "package"

    @property
    def run(self) -> Path:
        return self.out / "run"

    @property
    def adapter(self) -> Path:
        return self.out / "adapter"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="onboard-demo", help="folder for everything the demo writes (new or empty)")
    p.add_argument("--steps", type=positive_int, default=30, help="training steps (default 30)")
    p.add_argument("--force", action="store_true", help="replace a folder an earlier demo wrote")


def run(args, cli_main) -> Exit:
    """0 when every stage succeeded and the adapter reproduces our logits in transformers + peft. Each stage
    runs through `cli_main`, the `onboard` command's own main (handed down by onboard/cli.py, which sits above)."""
    import torch

    started = time.perf_counter()
    paths = Paths(_fresh_folder(Path(args.out).absolute(), args.force))
    torch.set_num_threads(1)
    for argv in commands(paths, args.steps):
        code = _stage(argv, cli_main)
        if code:
            print(f"onboard demo: `onboard {argv[0]}` exited {code}; stopped (the folders so far are in {paths.out})",
                  file=sys.stderr)
            return code
    check = adapter_check(paths)
    print(check.line())
    _print_where(paths, time.perf_counter() - started)
    return Exit.OK if check.passed else Exit.GAPS


def _fresh_folder(out: Path, force: bool) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not (force and (out / MARKER).exists()):
            why = "pass --force to replace this earlier demo" if (out / MARKER).exists() else "not written by a demo"
            raise BadInput(out, None, f"exists and is not empty ({why}); choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by `onboard demo`; `onboard demo --force` may replace this folder\n")
    return out


def commands(paths: Paths, steps: int) -> list[list[str]]:
    """The CLI commands the demo runs, in order."""
    return [["example-model", FAMILY, "--out", str(paths.release)],
            ["new-model", str(paths.release), "--out", str(paths.package)],
            ["train", str(paths.package), "--data", str(DATA), "--steps", str(steps), "--seq-len", str(SEQ_LEN),
             "--lr", LR, "--eval-every", str(max(1, steps // 3)), "--checkpoint-every", str(steps),
             "--out", str(paths.run)],
            ["export", str(paths.run), "--peft", str(paths.adapter)]]


def _stage(argv: list[str], cli_main) -> int:
    print(f"\n$ onboard {' '.join(argv)}", flush=True)
    return cli_main(argv)


@dataclass(frozen=True)
class AdapterCheck:
    max_abs_diff: float  # transformers + peft vs our runtime, same trained adapter
    max_abs_logit: float
    tolerance: float  # on max_abs_diff / max_abs_logit
    adapter_effect: float  # max |logits with the adapter - logits without|

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance * self.max_abs_logit

    def line(self) -> str:
        verdict = "pass" if self.passed else "FAIL"
        return (f"\ntransformers + peft with the exported adapter vs our runtime, fp32 logits: max |diff| "
                f"{self.max_abs_diff:.3g} (max |logit| {self.max_abs_logit:.3g}; bar {self.tolerance:g} of it): "
                f"{verdict}; the adapter moves the logits by up to {self.adapter_effect:.3g}")


def adapter_check(paths: Paths) -> AdapterCheck:
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from onboard.align.reference import load_reference, load_runtime
    from onboard.package.reader import read_package
    from runtime.lora.factors import apply_lora, load_lora_state_dict
    from runtime.tolerances import tolerance_for
    from runtime.train.run_folder import read_adapter

    package = read_package(paths.package)
    config, state = read_adapter(paths.run)
    ours = load_runtime(package.spec, package.weight_map, package.source, torch.float32)
    apply_lora(ours, config)
    load_lora_state_dict(ours, state)
    theirs = PeftModel.from_pretrained(load_reference(package.source, package.spec["family"], torch.float32),
                                       paths.adapter).eval()
    ids = AutoTokenizer.from_pretrained(paths.release, trust_remote_code=False)(SAMPLE, return_tensors="pt").input_ids
    with torch.no_grad():
        expected, actual = ours.eval()(ids).float(), theirs(input_ids=ids, use_cache=False).logits.float()
        with theirs.disable_adapter():
            base = theirs(input_ids=ids, use_cache=False).logits.float()
    return AdapterCheck(float((actual - expected).abs().max()), float(expected.abs().max()),
                        tolerance_for("model_logits", torch.float32).max_abs_rel, float((actual - base).abs().max()))


def _print_where(paths: Paths, seconds: float) -> None:
    losses = [line for line in map(json.loads, (paths.run / "metrics.jsonl").read_text().splitlines())
              if line["kind"] == "train"]
    rows = [("PR.md", paths.package / "PR.md", "what was recognized and aligned, and what a person must check"),
            ("gap report", paths.package / "gap_report.md", "every op of the model: covered, own module or missing"),
            ("alignment", paths.package / "alignment" / "report.json", "every check of tiers 0-2, metric and bar"),
            ("plots", paths.run / "loss.png", "and grad_norm.png, expert_load.png beside it"),
            ("metrics", paths.run / "metrics.jsonl", "one line per step"),
            ("PEFT adapter", paths.adapter, f"PeftModel.from_pretrained(<{paths.release}>, <this folder>)"),
            ("release", paths.release, "the tiny qwen3_next release the package was made from")]
    print(f"\ndemo done in {seconds:.0f} s; train loss {losses[0]['loss']:.3f} -> {losses[-1]['loss']:.3f} over "
          f"{len(losses)} steps. Open:")
    for label, path, what in rows:
        print(f"  {label:<13} {path}\n  {'':<13} {what}")
