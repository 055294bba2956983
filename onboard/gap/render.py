"""Render reports: Markdown through the Jinja templates, the terminal through rich.

Names come from the release (config keys, tensor names): every one is shown with control
characters escaped, and through rich with its markup escaped, so `[/x]` or a newline in a
name prints as itself.
"""
from __future__ import annotations

from pathlib import Path

import jinja2
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import templates
from onboard.errors import printable
from onboard.gap.report import GapReport

# found by the package, not by this file's place, so the module can move
TEMPLATES = Path(templates.__file__).resolve().parent
STATUS_STYLE = {"covered": "green", "variant": "yellow", "generated": "cyan", "own": "magenta", "missing": "red"}


def jinja_env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=False,
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def gap_markdown(report: GapReport) -> str:
    data = _printable(report.model_dump())
    return jinja_env().get_template("gap_report.md.j2").render(r=data, m=data["model"], mem=data["memory"])


def _printable(value):
    """The report's data with every string (keys too) on one line, control characters escaped."""
    if isinstance(value, dict):
        return {_printable(k): _printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable(v) for v in value]
    return printable(value) if isinstance(value, str) else value


def _t(value) -> str:
    """One release-supplied value as rich text: printable and markup-escaped."""
    return escape(printable(str(value)))


def print_gap_report(report: GapReport, console: Console | None = None) -> None:
    # piped output (CI logs, `| less`) has no terminal width: keep module paths readable there
    # no automatic highlighting: rich's repr highlighter runs regexes that take time quadratic in a
    # line's length over text that comes from the release (a long name hung the command)
    console = console or Console(width=None if Console().is_terminal else 140, highlight=False)
    m, mem = report.model, report.memory
    console.print(f"[bold]{_t(m['architecture'])}[/] ({_t(m['family'])}): {m['num_layers']} layers "
                  + ", ".join(f"{n} x {_t(k)}" for k, n in m["layer_kinds"].items()))
    own = f" ({m['moe_layers_own']} run as own modules)" if m.get("moe_layers_own") else ""
    attention = ", ".join(f"{n} {k}" for k, n in m["attention_kinds"].items() if n)
    vision = "yes" if m["vision"] else f"not supported ({_t(m['vision_not_supported'])})" \
        if m.get("vision_not_supported") else "no"
    console.print(f"params {m['params_total']:.4g} total, {m['params_active']:.4g} active; experts "
                  f"{m['num_experts']} routed top-{m['top_k']}, {m['num_shared_experts']} shared, {m['moe_layers']} MoE "
                  f"layers{own}; attention: {attention}; vision: {vision}")
    if m.get("stored_as"):
        console.print(f"stored as: {_t(m['stored_as'])}")
    table = Table(title="operators")
    for column in ("op", "covers", "status", "layers", "runtime op", "kernel"):
        table.add_column(column)
    for o in report.ops:
        style = STATUS_STYLE[o.status]
        table.add_row(o.op, o.covers, f"[{style}]{o.status}[/]", str(len(o.layers)), o.runtime_op or "-", o.kernel or "-")
    console.print(table)
    k = report.kernels
    console.print(f"fused kernels here: {'[green]yes[/]' if k.available else '[yellow]no[/]'}, {_t(k.reason)}")
    w = report.weights
    use = "for the vision tower" if m["vision"] else "not used: the vision tower is not supported"
    vision = f" (+ {w.vision_tensors} vision tensors, {use})" if w.vision_tensors else ""
    console.print(f"weights: {w.present} present / {w.expected} expected{vision}, {len(w.missing)} missing, "
                  f"{len(w.unexpected)} unexpected, shapes {'checked' if w.shapes_checked else 'not checked (index only)'}")
    console.print(f"memory: weights {mem.weights_gib:.1f} GiB{' as stored' if mem.weights_stored_as else ''}, LoRA r{mem.lora_rank} {mem.lora_params:,} params, "
                  f"activations/GPU {mem.per_gpu_activations_gib:.2f} GiB at seq {mem.seq_len}; "
                  f"min GPUs ({mem.gpu_mem_gib:g} GiB): {mem.min_gpus}")
    if report.meta_check:
        c = report.meta_check
        verdict = "[green]agrees[/]" if c.agrees else f"[red]disagrees[/] {_t(c.layer_disagreements[:3])}"
        console.print(f"transformers {_t(c.model_class)} on meta: {c.params:,} params, {verdict}")
    act = m.get("activation")
    if act and not act["computed"]:
        said = ", ".join(f"{k}={v}" for k, v in act["parameters"].items())
        console.print(f"activation {_t(act['name'])}{f' ({_t(said)})' if said else ''}: not an activation the runtime computes")
    if m.get("generation_keys"):
        console.print(f"generation settings (no architecture; not used): {_t(', '.join(m['generation_keys']))}")
    for u in report.unrecognized:
        console.print(f"[yellow]unrecognized[/] {_t(u.item)} ({_t(u.source)}) {_t(u.detail)}")
