"""Alignment tier 2: the whole model against the model's own transformers implementation.

Logits and loss in fp32 and bf16, MoE routing flips counted; on failure every layer is isolated on
transformers' own input to it, to name the first that diverges and the component (attention or FFN)
inside it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from onboard.align.progress import Progress
from onboard.align.reference import Recorder, load_reference, load_runtime, random_tokens
from onboard.align.release_code import ReferenceFailed, require_runnable_here, ships_code, whole_model_truth
from onboard.align.report import Check, Divergence, with_scales
from onboard.align.stored import scales_read
from onboard.align.tiers import own_choices
from runtime.model.own_modules import runs_own_code
from runtime.model.rotary import RotaryCache
from runtime.registry import ops_for_layer
from runtime.spec import ModelSpec
from runtime.tolerances import BF16_LOGITS_MARGIN, bf16_logits_bar, compare, tolerance_for

def _routing_flips(ours, recorder: Recorder, num_layers: int) -> list[Check]:
    """Tokens whose expert set differs when our router sees transformers' hidden states instead of ours."""
    checks = []
    for i, layer in enumerate(ours.layers[:num_layers]):
        if not hasattr(getattr(layer, "ffn", None), "router"):
            continue
        x = recorder.input("ffn", i)
        with torch.no_grad():
            _, idx_theirs = layer.ffn.router(x.reshape(-1, x.shape[-1]).to(layer.ffn.router.weight.dtype))
        ours_sets, theirs_sets = layer.ffn.last_routing.sort(-1).values, idx_theirs.sort(-1).values
        flips = int((ours_sets != theirs_sets).any(-1).sum())
        checks.append(Check(tier=2, name=f"layer{i}/routing_flips", metric="routing_flips", value=flips, tolerance=0,
                            verdict="info", layer=i, op="moe_router", detail=f"of {ours_sets.shape[0]} tokens"))
    return checks


def _choices(model) -> dict[str, torch.Tensor]:
    """Every discrete choice of the last forward: MoE expert sets and DSA key selections, by module name."""
    out = {}
    for name, module in model.named_modules():
        chosen = getattr(module, "last_routing", None) if hasattr(module, "router") else getattr(module, "last_selection", None)
        if chosen is not None:
            out[name] = chosen
    return out


def _pin(model, choices: dict[str, torch.Tensor] | None) -> None:
    modules = dict(model.named_modules())
    for name, chosen in (choices or {}).items():
        target = modules[name].router if hasattr(modules[name], "router") else modules[name]
        target.pinned_idx = chosen
    if choices is None:
        for module in model.modules():
            if hasattr(module, "pinned_idx"):
                module.pinned_idx = None


def _choice_flips(ours: dict, truth: dict) -> int:
    """Tokens whose chosen set (experts or keys) differs, summed over layers."""
    return sum(int((ours[n].sort(-1).values != truth[n].sort(-1).values).any(-1).sum()) for n in truth if n in ours)


def tier2(spec: ModelSpec, weight_map: dict, source: Path, num_layers: int, T: int = 24, seed: int = 1,
          tamper=None, progress: Progress | None = None) -> tuple[list[Check], Divergence | None]:
    """fp32: logits and loss vs transformers in fp32. bf16: our bf16 model vs transformers in fp32 (the truth),
    with expert and key choices pinned to the fp32 run's; the free-running bf16 error and its choice flips are
    reported beside it. `tamper(model)` edits our model after loading (tests break an op on purpose)."""
    progress = progress or Progress()
    progress.plan(2)
    progress.group("float32 logits and loss")
    ids, divergence, their_bf16 = random_tokens(spec, 2, T, seed), None, None
    if ships_code(source):
        # the release's own code is the reference, run confined
        truth, recorder, their_bf16 = whole_model_truth(source, num_layers, ids)
        require_runnable_here(spec, f"gave logits of shape {tuple(truth.shape)}")
    else:
        ref = load_reference(source, spec.family, torch.float32, num_layers)
        recorder = Recorder(ref)
    ours = load_runtime(spec, weight_map, source, torch.float32, num_layers)
    if tamper is not None:
        tamper(ours)
    own_truth = {}
    hooks = own_choices.record(ours, own_truth)
    with torch.no_grad():
        if their_bf16 is None:
            truth = ref(input_ids=ids, use_cache=False).logits.float()
        logits = ours(ids)
    recorder.close()
    own_choices.remove(hooks)
    scales = scales_read(weight_map, range(num_layers), outside=True)
    checks = with_scales([logits_check("logits/float32", compare(logits, truth, tolerance_for("model_logits", torch.float32)),
                                       torch.float32), _loss_check("float32", logits, truth, ids, torch.float32)], scales)
    checks += _recorded(lambda: _routing_flips(ours, recorder, num_layers), [])
    if any(c.verdict == "fail" for c in checks):
        divergence = _recorded(lambda: first_divergence(ours, recorder, num_layers, T), None)
    progress.group("bfloat16 logits and loss")
    checks += with_scales(_bf16_checks(spec, weight_map, source, num_layers, ids, truth, (_choices(ours), own_truth), tamper,
                                       their_bf16), scales)
    return checks, divergence


def _recorded(find, otherwise):
    """What needs the reference's per-layer recording; `otherwise` where the release's code gave none (its layers
    take something else than hidden states)."""
    try:
        return find()
    except ReferenceFailed:
        return otherwise


def _bf16_checks(spec, weight_map, source, num_layers, ids, truth, choices, tamper, theirs_bf16=None) -> list[Check]:
    """choices: (registry modules' choices, own modules' expert choices) of the fp32 run; theirs_bf16: the
    reference's bf16 logits when already computed (the release's code, run confined)."""
    ours = load_runtime(spec, weight_map, source, torch.bfloat16, num_layers)
    if tamper is not None:
        tamper(ours)
    (registry_truth, own_truth), own_free = choices, {}
    with torch.no_grad():
        hooks = own_choices.record(ours, own_free)
        free = ours(ids)
        own_choices.remove(hooks)
        flips = _choice_flips(_choices(ours), registry_truth)
        flips += _choice_flips(own_choices.indices(own_free), own_choices.indices(own_truth))
        _pin(ours, registry_truth)
        hooks = own_choices.pin(ours, own_truth)
        pinned = ours(ids)
        own_choices.remove(hooks)
        _pin(ours, None)
        if theirs_bf16 is None:
            theirs_bf16 = load_reference(source, spec.family, torch.bfloat16, num_layers)
            theirs_bf16 = theirs_bf16(input_ids=ids, use_cache=False).logits.float()
    floor, note = tolerance_for("model_logits", torch.bfloat16), "expert/key choices pinned to fp32's"
    free_c, own_c = compare(free, truth, floor), compare(theirs_bf16, truth, floor)
    tol = bf16_logits_bar(own_c.rel_rms)
    note += f"; bar max({floor.rel_rms:.0e}, {BF16_LOGITS_MARGIN} x transformers' bf16 error)"
    if runs_own_code(ours):
        # their expert choices are pinned where they call their experts; other choices inside transformers'
        # code cannot be
        note += " (own modules' at their experts call)"
    return [logits_check("logits/bfloat16", compare(pinned, truth, tol), torch.bfloat16, note),
            _loss_check("bfloat16", pinned, truth, ids, torch.bfloat16),
            Check(tier=2, name="logits/bfloat16-free", metric="rel_rms", value=free_c.rel_rms, tolerance=tol.rel_rms,
                  verdict="info", detail=f"choices free: {flips} token choice flips vs fp32 across layers"),
            Check(tier=2, name="logits/bfloat16-transformers", metric="rel_rms", value=own_c.rel_rms, tolerance=tol.rel_rms,
                  verdict="info", detail="transformers' own bf16 run vs its fp32 run, for scale")]


def logits_check(name: str, c, dtype, note: str = "") -> Check:
    """fp32 logits are judged on max-abs, bf16 logits on rel RMS."""
    if dtype == torch.float32:
        return Check(tier=2, name=name, metric="max_abs_rel", value=c.max_abs_rel, tolerance=c.tolerance.max_abs_rel,
                     verdict="pass" if c.finite and c.max_abs_rel <= c.tolerance.max_abs_rel else "fail",
                     detail=f"rel_rms={c.rel_rms:.3e}")
    return Check(tier=2, name=name, metric="rel_rms", value=c.rel_rms, tolerance=c.tolerance.rel_rms,
                 verdict="pass" if c.finite and c.rel_rms <= c.tolerance.rel_rms else "fail",
                 detail=f"max_abs_rel={c.max_abs_rel:.3e}; {note}".rstrip("; "))


def _loss_check(tag: str, ours, theirs, ids, dtype) -> Check:
    from runtime.model.decoder import causal_lm_loss

    a, b = causal_lm_loss(ours, ids).item(), causal_lm_loss(theirs, ids).item()
    tol = tolerance_for("model_loss", dtype).rel_rms
    rel = abs(a - b) / abs(b)
    return Check(tier=2, name=f"loss/{tag}", metric="rel_diff", value=rel, tolerance=tol,
                 verdict="pass" if rel <= tol else "fail", detail=f"ours={a:.6f} transformers={b:.6f}")


def first_divergence(ours, recorder: Recorder, num_layers: int, T: int) -> Divergence | None:
    """Each layer on transformers' own input to it: the first whose output disagrees, then which part (and the
    registry ops of that part, from the spec our model was built from)."""
    rotary = RotaryCache(torch.arange(T).expand(recorder.input("layer", 0).shape[0], -1))
    tol = tolerance_for("layer", torch.float32)
    with torch.no_grad():
        for i, layer in enumerate(ours.layers[:num_layers]):
            if compare(layer(recorder.input("layer", i), rotary), recorder.output("layer", i), tol).passed:
                continue
            if layer.own is not None:
                return Divergence(layer=i, component="layer", kind="own_layer", ops=[], value=float("inf"), tolerance=tol.rel_rms)
            attn = compare(layer.attn(recorder.input("attention", i), rotary), recorder.output("attention", i), tol)
            ffn = compare(layer.ffn(recorder.input("ffn", i)), recorder.output("ffn", i), tol)
            part, c = ("attention", attn) if not attn.passed or ffn.passed else ("ffn", ffn)
            layer_spec = ours.config.layers[i]
            ops = [op for op, _ in ops_for_layer(layer_spec.attention, layer_spec.ffn, ours.config.stored_format)
                   # a stored linear decodes projections of either part
                   if op == "stored_linear" or (part == "attention") != op.startswith(("moe_", "swiglu_"))]
            kind = layer_spec.attention.kind if part == "attention" else layer_spec.ffn.kind
            return Divergence(layer=i, component=part, kind=kind, ops=ops, value=c.rel_rms, tolerance=c.tolerance.rel_rms)
    return None
