"""Tier-0 inputs of the ops that decode a stored base weight (`stored_linear`, `moe_experts_stored`): the release's own
packed codes and scale tensors, put together as the weight map says (per-expert and gate/up tensors into the stacked
[E, 2F, D] codes the runtime keeps; the first MAX_EXPERTS experts), with random activations, routing and LoRA factors
at those widths. Both the op and its fp64 twin decode the same bytes; one case per distinct stored shape, in layer
order, so every width the package decodes at is checked once.

Shape legend: T tokens, O rows (out width), I columns (in width), E experts, F expert width, D model width, r rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from onboard.align.stored import ReleaseReader, fold_experts
from onboard.align.tiers.cases import MAX_EXPERTS, Case, activation_kwargs
from runtime.formats.scheme import StoredEntry
from runtime.spec import ModelSpec, MoEFFN

LORA_RANK = 4
LORA_SCALE = 2.0
EXPERT_TARGETS = ("experts.w_gate_up", "experts.w_down")


@dataclass
class StoredTensors:
    """One runtime tensor's codes and scale as the runtime holds them, and the released scale tensors they came from."""
    entry: StoredEntry
    codes: torch.Tensor
    scale: torch.Tensor
    scales: list[str] = field(default_factory=list)

    def format_kwargs(self) -> dict:
        fmt = self.entry.format
        return {"kind": fmt.kind, "block": tuple(fmt.block) if fmt.kind == "fp8_block" else None}

    def key(self) -> tuple:
        return (tuple(self.codes.shape), self.codes.dtype, tuple(self.scale.shape), self.scale.dtype)


@dataclass
class StoredCase:
    """A decoding op on one set of stored tensors: `make(seed, dtype)` draws the rest of its arguments."""
    op: str
    label: str  # the runtime tensor (or expert layer) the bytes stand for
    make: Callable[[int, torch.dtype], Case]
    scales: list[str]


def _as_runtime(entry: StoredEntry, codes: torch.Tensor) -> torch.Tensor:
    # gpt-oss's blocks [.., O, G, 16] are passed as their view [.., O, G * 16] (runtime/ops/stored_matmul/README.md)
    return codes.flatten(-2) if entry.format.kind == "mxfp4" and entry.format.layout == "blocks" else codes


def _scale_row(entry: StoredEntry, row: int) -> int:
    """The scale row a codes row starts: FP8 scales have one row per block of rows, MXFP4 scales share the rows."""
    if entry.format.kind != "fp8_block":
        return row
    block_rows = entry.format.block[0]
    if row % block_rows:
        raise ValueError(f"{entry.codes}: rows from {row} do not start on a {block_rows}-row block")
    return row // block_rows


def assemble(pieces: list[tuple[str, dict]], release: ReleaseReader) -> StoredTensors:
    """The runtime tensor's codes and scale from its weight-map entries (`expert` and `rows` steps; a whole stacked
    tensor cut to MAX_EXPERTS experts)."""
    entries = [(StoredEntry.model_validate(e["stored"]), e) for _, e in pieces]
    first = entries[0][0]
    if len(entries) == 1 and entries[0][1]["expert"] is None and entries[0][1]["rows"] is None:
        # a stacked [E, ..] tensor (gpt-oss's blocks have one more dim than the [E, O, I] they hold)
        stacked = len(release.shape(first.scale)) > 2
        cut = MAX_EXPERTS if stacked else None
        return StoredTensors(first, _as_runtime(first, release.read(first.codes, cut)), release.read(first.scale, cut),
                             fold_experts([first.scale]))
    kept = [(s, e) for s, e in entries if e["expert"] is None or e["expert"] < MAX_EXPERTS]
    parts = [(s, e, _as_runtime(s, release.read(s.codes)), release.read(s.scale)) for s, e in kept]
    return _place(first, parts)


def _place(first: StoredEntry, parts: list) -> StoredTensors:
    """Codes and scale pieces written into their [E, O, ..] (or [O, ..]) slots."""
    experts = 1 + max((e["expert"] for _, e, _, _ in parts if e["expert"] is not None), default=-1)
    rows = max((e["rows"] or [0, c.shape[-2]])[1] for _, e, c, _ in parts)
    scale_rows = max(_scale_row(s, (e["rows"] or [0])[0]) + sc.shape[-2] for s, e, _, sc in parts)
    lead = (experts,) if experts else ()
    _, _, c0, s0 = parts[0]
    codes = torch.zeros(lead + (rows, c0.shape[-1]), dtype=c0.dtype)
    scale = torch.zeros(lead + (scale_rows, s0.shape[-1]), dtype=s0.dtype)
    for s, e, c, sc in parts:
        r0 = (e["rows"] or [0])[0]
        at = (e["expert"],) if e["expert"] is not None else ()
        codes[at + (slice(r0, r0 + c.shape[-2]),)] = c
        q0 = _scale_row(s, r0)
        scale[at + (slice(q0, q0 + sc.shape[-2]),)] = sc
    return StoredTensors(first, codes, scale, fold_experts([s.scale for s, _, _, _ in parts]))


def _targets(weight_map: dict) -> dict[str, list[tuple[str, dict]]]:
    """runtime tensor -> its stored weight-map entries, in release order."""
    out: dict[str, list] = {}
    for name, entry in weight_map.items():
        if entry.get("stored") and entry.get("target"):
            out.setdefault(entry["target"], []).append((name, entry))
    return out


def stored_cases(spec: ModelSpec, weight_map: dict, source: Path, T: int) -> list[StoredCase]:
    """One case per distinct stored linear and per distinct stored expert layer, in layer order."""
    targets, cases, seen = _targets(weight_map), [], set()
    with ReleaseReader(source) as release:
        for target, pieces in targets.items():
            if target.endswith(EXPERT_TARGETS):
                continue
            tensors = assemble(pieces, release)
            bias = target.removesuffix(".weight") + ".bias"
            key = ("stored_linear", tensors.key(), bias in _all_targets(weight_map))
            if key not in seen:
                seen.add(key)
                cases.append(_linear_case(target, tensors, key[2], T))
        for layer in spec.layers:
            prefix = f"layers.{layer.index}.ffn."
            gate_up, down = (targets.get(prefix + t) for t in EXPERT_TARGETS)
            if not isinstance(layer.ffn, MoEFFN) or not gate_up or not down:
                continue
            pair = assemble(gate_up, release), assemble(down, release)
            key = ("moe_experts_stored", pair[0].key(), pair[1].key(), layer.ffn.model_dump_json())
            if key not in seen:
                seen.add(key)
                cases.append(_experts_case(f"layers.{layer.index}.ffn.experts", pair, layer.ffn, T))
    return cases


def _all_targets(weight_map: dict) -> set[str]:
    return {e.get("target") for e in weight_map.values()}


def _frozen(case: Case, name: str, value: torch.Tensor) -> None:
    """A stored tensor: passed as released to both sides (no dtype cast), never differentiated."""
    case.set(name, value)
    case.frozen.add(name)


def _linear_case(target: str, t: StoredTensors, bias: bool, T: int) -> StoredCase:
    O, I = t.codes.shape[-2], t.codes.shape[-1] * (2 if t.entry.format.kind == "mxfp4" else 1)

    def make(seed: int, dtype: torch.dtype) -> Case:
        c = Case(torch.Generator().manual_seed(seed), dtype)
        c.rand("x_TI", 1, T, I)
        _frozen(c, "codes", t.codes)
        _frozen(c, "scale", t.scale)
        c.kwargs.update(t.format_kwargs(), lora_scale=LORA_SCALE)
        if bias:
            c.rand("bias_O", O, scale=0.1)
        c.rand("lora.0", LORA_RANK, I, scale=I ** -0.5)
        c.rand("lora.1", O, LORA_RANK, scale=0.1)
        return c

    return StoredCase("stored_linear", target, make, t.scales)


def _experts_case(label: str, pair: tuple[StoredTensors, StoredTensors], ffn: MoEFFN, T: int) -> StoredCase:
    gate_up, down = pair
    E, D, F_ = gate_up.codes.shape[0], down.codes.shape[-2], gate_up.codes.shape[-2] // 2

    def make(seed: int, dtype: torch.dtype) -> Case:
        c = Case(torch.Generator().manual_seed(seed), dtype)
        k = min(ffn.top_k, E)
        c.rand("x_TD", T, D)
        scores = torch.rand(T, E, generator=c.gen, dtype=torch.float64)
        top, idx = scores.topk(k, dim=-1)
        c.set("weights_Tk", (top / top.sum(-1, keepdim=True)).to(dtype))
        c.grads.append("weights_Tk")
        c.set("idx_Tk", idx)
        for name, t in (("gate_up", gate_up), ("down", down)):
            _frozen(c, f"{name}_codes", t.codes)
            _frozen(c, f"{name}_scale", t.scale)
        c.kwargs.update(gate_up.format_kwargs(), clamp=ffn.swiglu_limit, glu_alpha=ffn.swiglu_alpha,
                        interleaved_gate_up=ffn.interleaved_gate_up, lora_scale=LORA_SCALE,
                        **activation_kwargs(ffn.model_dump(mode="json")))
        if ffn.expert_bias:
            c.rand("b_gate_up_E2F", E, 2 * F_, scale=0.1)
            c.rand("b_down_ED", E, D, scale=0.1)
        c.rand("lora_gate_up.0", E, LORA_RANK, D, scale=D ** -0.5)
        c.rand("lora_gate_up.1", E, 2 * F_, LORA_RANK, scale=0.1)
        c.rand("lora_down.0", E, LORA_RANK, F_, scale=F_ ** -0.5)
        c.rand("lora_down.1", E, D, LORA_RANK, scale=0.1)
        return c

    return StoredCase("moe_experts_stored", label, make, sorted(set(gate_up.scales + down.scales)))
