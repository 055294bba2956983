"""The family sweep: every MoE family of the installed transformers, built tiny and run through the CLI.

A family is MoE when its default config (or its text part) sets an expert count; it is tried
when transformers has a causal-LM or image-text-to-text class for it. Its config is shrunk by
onboard/examples/tiny_config.py (no family named), built with random weights and written by
save_pretrained; then `inspect` and `new-model` (which aligns a package without gaps, tiers 0-2) run
as the CLI runs them, `align --tiers 0,1,2` too where new-model left gaps, and `train` (4 LoRA steps)
on every exit-0 package; each exit code and any escaped exception is recorded. `python -m onboard.family_sweep FAMILY DIR`
runs one family and prints its result as JSON (bench/family_sweep.py runs them all, one process each).
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback
from pathlib import Path
from typing import Optional

from pydantic import BaseModel

from onboard.examples.tiny_config import shrink
from onboard.exit_codes import Exit

# Above this the shrink did not make the model tiny (the 12 named examples are 0.1-0.5M).
MAX_TINY_PARAMS = 8_000_000
# LoRA steps every exit-0 package trains in the sweep
TRAIN_STEPS = 4
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


class StepResult(BaseModel):
    exit_code: Optional[int]  # None: an exception escaped the CLI
    traceback: str = ""
    stderr_tail: str = ""


class FamilyResult(BaseModel):
    family: str
    model_class: str
    built: bool
    not_built_reason: str = ""
    tiny_params: int = 0
    layer_kinds: dict[str, int] = {}
    ops: dict[str, list[str]] = {}  # status -> op names
    unrecognized: list[str] = []
    steps: dict[str, StepResult] = {}
    tiers_passed: list[int] = []
    failed_checks: list[str] = []  # the first failed alignment checks, with their detail
    demotions: list[str] = []  # new-model's demotions after a failed alignment (onboard/review/demotion.py); ops are then the package's


def model_classes() -> dict[str, str]:
    from onboard.recognize.meta_check import transformers_class_names

    return transformers_class_names()


def _parts(config) -> list:
    """The config and its text part (a config with several text parts is judged at the top level)."""
    try:
        return [config, config.get_text_config()]
    except ValueError:
        return [config]


def _expert_count(config) -> int:
    counts = [getattr(p, k, None) for p in _parts(config) for k in EXPERT_COUNT_KEYS]
    return max((c for c in counts if type(c) is int), default=0)


def moe_families() -> tuple[list[str], dict[str, str]]:
    """(MoE families, {family: why its default config could not be read})."""
    from transformers import AutoConfig

    found, unreadable = [], {}
    for family in sorted(model_classes()):
        try:
            config = AutoConfig.for_model(family)
        except Exception as err:  # a default config transformers itself refuses: listed with the reason
            unreadable[family] = f"default config: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
            continue
        if _expert_count(config) > 1 or _declares_experts(config):
            found.append(family)
    return found, unreadable


def _declares_experts(config) -> bool:
    """Families whose default sets one expert (a switch, e.g. HunYuan's num_experts=1) but a top-k key too."""
    keys = {k for p in _parts(config) for k, v in p.to_dict().items() if type(v) is int and v > 0}
    return bool(keys & set(EXPERT_COUNT_KEYS)) and any("experts_per" in k or k in ("moe_topk", "moe_k") for k in keys)


def tiny_config(family: str):
    from transformers import AutoConfig

    default = AutoConfig.for_model(family).to_dict()
    small = {k: v for k, v in shrink(default).items() if k not in ("model_type", "transformers_version")}
    return AutoConfig.for_model(family, **small)


def build_tiny(family: str, seed: int = 0):
    """(model, param count): the family's class at its shrunk config, random weights moved off their init."""
    import torch

    cls = getattr(__import__("transformers"), model_classes()[family])
    config = tiny_config(family)
    with torch.device("meta"):
        params = sum(p.numel() for p in cls(config).parameters())
    if params > MAX_TINY_PARAMS:
        raise ValueError(f"shrunk config still has {params / 1e6:.1f}M parameters")
    torch.manual_seed(seed)
    from onboard.examples.models import perturb

    model = cls(config)
    perturb(model, seed)
    _runs(model.eval())
    return model, params


def _runs(model) -> None:
    """A tiny model transformers cannot run itself (a default config that leaves a value to the release, a
    width fixed in the family's code that the shrink cannot see) is not built: no check could pass on it."""
    import torch

    try:
        with torch.no_grad():
            model(input_ids=torch.arange(1, 9)[None], use_cache=False)
    except Exception as err:
        first = str(err).splitlines()[0][:160] if str(err) else ""
        raise ValueError(f"the shrunk model does not run in transformers: {type(err).__name__}: {first}") from err


def _run_cli(argv: list[str]) -> tuple[StepResult, str]:
    from onboard.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code, tb = main(argv), ""
        except SystemExit as exc:
            code, tb = int(exc.code or 0), ""
        except BaseException:  # what the sweep is looking for: anything that escapes the CLI
            code, tb = None, traceback.format_exc()
    tail = err.getvalue().strip().splitlines()[-3:]
    return StepResult(exit_code=code, traceback=tb[-2000:], stderr_tail="\n".join(tail)[-600:]), out.getvalue()


def run_family(family: str, workdir: Path) -> FamilyResult:
    from onboard.examples.models import save_release

    result = FamilyResult(family=family, model_class=model_classes()[family], built=False)
    release, pkg = Path(workdir) / "release", Path(workdir) / "pkg"
    try:
        model, result.tiny_params = build_tiny(family)
        save_release(model, release, num_shards=2)
    except Exception as err:  # a family the generic shrink cannot make tiny: listed with the reason
        result.not_built_reason = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        return result
    result.built = True
    result.steps["inspect"], report = _run_cli(["inspect", str(release), "--json"])
    _read_report(result, report)
    result.steps["new-model"], _ = _run_cli(["new-model", str(release), "--out", str(pkg)])
    _read_demotions(result, pkg)
    # new-model aligns a package without gaps itself; a package with gaps is aligned here, to see where it fails
    if pkg.exists() and not (pkg / "alignment" / "report.json").exists():
        result.steps["align"], _ = _run_cli(["align", str(pkg), "--tiers", "0,1,2"])
    result.tiers_passed, result.failed_checks = _alignment(pkg)
    if result.steps["new-model"].exit_code == Exit.OK:
        result.steps["train"], _ = _run_cli(["train", str(pkg), "--data", str(_train_data(Path(workdir))), "--steps",
                                             str(TRAIN_STEPS), "--seq-len", "32", "--eval-every", str(TRAIN_STEPS),
                                             "--checkpoint-every", str(TRAIN_STEPS), "--no-progress"])
    return result


def _train_data(workdir: Path) -> Path:
    """A few short documents: enough packed rows of 32 tokens for 4 steps and an eval split."""
    path = workdir / "train.jsonl"
    path.write_text("".join(json.dumps({"text": f"The river runs past mill number {i} under the old stone bridge."})
                            + "\n" for i in range(12)))
    return path


def _read_report(result: FamilyResult, text: str) -> None:
    try:
        report = json.loads(text)
    except ValueError:
        return
    _read_ops(result, report)
    result.unrecognized = [u["item"] for u in report["unrecognized"]]


def _read_ops(result: FamilyResult, report: dict) -> None:
    result.layer_kinds, result.ops = report["model"]["layer_kinds"], {}
    for op in report["ops"]:
        result.ops.setdefault(op["status"], []).append(op["op"])


def _read_demotions(result: FamilyResult, pkg: Path) -> None:
    """A package demoted after a failed alignment runs what its own gap report says, not what inspect
    recognized."""
    path = pkg / "agents" / "demotions.json"
    result.demotions = [step["rung"] for step in json.loads(path.read_text())] if path.exists() else []
    if result.demotions:
        _read_ops(result, json.loads((pkg / "gap_report.json").read_text()))


def _alignment(pkg: Path) -> tuple[list[int], list[str]]:
    """(tiers passed, the first failed checks) of the package's alignment report."""
    path = pkg / "alignment" / "report.json"
    if not path.exists():
        return [], []
    tiers = json.loads(path.read_text())["tiers"]
    failed = [f"{c['name']}: {c['detail']}"[:240] for t in tiers for c in t["checks"] if c["verdict"] == "fail"]
    return [t["tier"] for t in tiers if t["passed"]], failed[:3]


def summary(results: list[FamilyResult]) -> dict[str, int]:
    """The sweep's counts; exit codes are new-model's (inspect's agree or the table shows it)."""
    built = [r for r in results if r.built]
    codes = [r.steps["new-model"].exit_code if "new-model" in r.steps else None for r in built]
    return {"tried": len(results), "built": len(built), "exit_0": codes.count(Exit.OK), "exit_3": codes.count(Exit.GAPS),
            "exit_2": codes.count(Exit.BAD_INPUT), "inspect_exit_2": sum(r.steps["inspect"].exit_code == Exit.BAD_INPUT for r in built),
            "tracebacks": sum(any(s.exit_code is None and not _timed_out(s) for s in r.steps.values()) for r in built),
            "timed_out": sum(any(_timed_out(s) for s in r.steps.values()) for r in built),
            "tiers_0_1_2_passed": sum(r.tiers_passed == [0, 1, 2] for r in built),
            "trained": sum(r.steps["train"].exit_code == Exit.OK for r in built if "train" in r.steps)}


def _timed_out(step: StepResult) -> bool:
    return step.exit_code is None and step.traceback.startswith("timed out")


def _code(r: FamilyResult, step: str) -> str:
    s = r.steps.get(step)
    return "-" if s is None else ("traceback" if s.exit_code is None else str(s.exit_code))


def _row(r: FamilyResult) -> str:
    if not r.built:
        return f"| {r.family} | {r.model_class} | not built | | | | | | | | | {r.not_built_reason.replace('|', '/')} |"
    kinds = ", ".join(f"{k} x{n}" for k, n in r.layer_kinds.items())
    registry = ", ".join(r.ops.get("covered", []) + [f"{o} (variant)" for o in r.ops.get("variant", [])])
    tiers = ",".join(map(str, r.tiers_passed)) or "none"
    own = ", ".join(r.ops.get("own", [])) + (f" (after alignment: {', '.join(r.demotions)})" if r.demotions else "")
    return (f"| {r.family} | {r.model_class} | {kinds} | {registry} | {own} | "
            f"{', '.join(r.ops.get('missing', []))} | {_code(r, 'inspect')} | {_code(r, 'new-model')} | "
            f"{_code(r, 'align')} | {tiers} | {_code(r, 'train')} | {_note(r)} |")


def _note(r: FamilyResult) -> str:
    """Why it is not exit 0: a traceback's last line, else the first failed check, a failed training's error,
    else what was not understood."""
    for step in r.steps.values():
        if step.exit_code is None:
            return "traceback: " + (step.traceback.strip().splitlines() or [""])[-1][:200].replace("|", "/")
    train = r.steps.get("train")
    if train is not None and train.exit_code != Exit.OK:
        return f"train: {train.stderr_tail.splitlines()[-1] if train.stderr_tail else ''}"[:240].replace("|", "/")
    if r.failed_checks:
        return r.failed_checks[0].replace("|", "/")
    return "; ".join(r.unrecognized[:4]).replace("|", "/")


def families_markdown(results: list[FamilyResult], command: str, date: str) -> str:
    counts = summary(results)
    lines = ["# Family sweep", "", f"`{command}` ({date}, CPU, installed transformers); one tiny release per MoE "
             "family with a causal-LM or image-text-to-text class, its default config shrunk by "
             "`onboard/examples/tiny_config.py` (no family named). Exit codes are the CLI's: 0 ok, 2 bad input, 3 gaps; "
             "`traceback`: an exception escaped the CLI.", "",
             " / ".join(f"{k}: {v}" for k, v in counts.items()), "",
             "| family | class | layer kinds | registry ops | own modules | missing | inspect | new-model | align | tiers passed "
             f"| train {TRAIN_STEPS} steps | notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [_row(r) for r in results]) + "\n"


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    sys.stdout.write(run_family(sys.argv[1], Path(sys.argv[2])).model_dump_json() + "\n")
