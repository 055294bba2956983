"""Tier 1's check on what a stored release's scales make of its weights: each decoded weight's gain.

Both sides of tiers 0-2 read the same scale tensors, so a scale that is wrong in the file (replaced by ones, taken
from another tensor) decodes alike on both and passes every comparison. What still gives it away is the weight it
decodes to: a linear map's gain, RMS(W) * sqrt(in width) (the output RMS it gives a unit-RMS input), stays within a
few of 1 in trained and freshly initialized transformers alike (initializers set it so, normalized residual blocks
keep it so). FP8 codes under a scale of 1 are the codes themselves (up to 448: gains in the hundreds at any width),
MXFP4 codes under the byte 1 are 2^-126 small: both miss the 1e-2..1e2 bar by far. Each weight matrix is judged alone
(each expert of a stacked tensor too), and one check per weight name reports the worst of its experts.
"""
from __future__ import annotations

import math
import re

import torch

from onboard.align.report import Check
from onboard.align.stored import ReleaseReader, fold_experts, in_prefix, layer_of

# |log10(gain)| at most this: gains within 1e-2..1e2
LOG10_GAIN_BAR = 2.0


def gains(decoded_OI: torch.Tensor) -> torch.Tensor:
    """RMS(W) * sqrt(I) of each [O, I] matrix of a [.., O, I] weight, flattened over the leading dims."""
    w = decoded_OI.reshape(-1, *decoded_OI.shape[-2:])
    return w.pow(2).mean(dim=(-2, -1)).sqrt() * math.sqrt(w.shape[-1])


def gain_checks(manifest, num_layers: int | None) -> list[Check]:
    """One check per stored weight of the aligned prefix, the experts of one weight together (named as a range)."""
    groups: dict[str, dict] = {}
    with ReleaseReader(manifest.root) as release:
        for name, entry in manifest.stored.items():
            if not in_prefix(name, num_layers):
                continue
            g = gains(release.decoded(entry))
            group = groups.setdefault(EXPERT_NUMBER.sub("*", name), {"names": [], "scales": [], "lo": math.inf, "hi": 0.0})
            group["names"].append(name)
            group["scales"].append(entry.scale)
            group["lo"], group["hi"] = min(group["lo"], float(g.min())), max(group["hi"], float(g.max()))
    return [_check(**group) for group in groups.values()]


# an expert number inside a tensor name (DeepSeek-V3's per-expert tensors: `...mlp.experts.17.down_proj.weight`)
EXPERT_NUMBER = re.compile(r"(?<=\.experts\.)\d+(?=\.)")


def _log_distance(lo: float, hi: float) -> float:
    """How far the farther of the two gains is from 1, in decades (inf for an all-zero weight)."""
    return max(abs(math.log10(g)) if g > 0 else math.inf for g in (lo, hi))


def _check(names: list[str], scales: list[str], lo: float, hi: float) -> Check:
    distance, name = _log_distance(lo, hi), fold_experts(names)[0]
    return Check(tier=1, name=f"stored/{name}/gain", metric="log10_gain", value=distance, tolerance=LOG10_GAIN_BAR,
                 verdict="pass" if distance <= LOG10_GAIN_BAR else "fail", op="stored_weight", layer=layer_of(name),
                 detail=f"gain {lo:.3g}..{hi:.3g} (RMS x sqrt(in width) of each decoded matrix); a weight a network was "
                        f"trained or initialized with lies within 1e-2..1e2: outside, a scale tensor is not this "
                        f"weight's", scales=fold_experts(scales))
