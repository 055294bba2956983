"""`onboard align PKG`: the package's numerical alignment evidence, tier by tier.

The tiers are in tiers/. Tier 0 (tier0_ops, cases): every op the package uses vs the fp64 reference ops.
Tier 1 (tier1_layers): each distinct layer type vs transformers' own layer. Tier 2 (tier2_model,
tier2_training, vision): the whole model's logits and loss, LoRA training against transformers + PEFT, and
the vision path of multimodal models. Tier 3 (tier3): FSDP x EP processes vs one. Tier 4 (tier4): the plan's
placement for a target cluster, on paper (meta device, no processes). Here: reference.py loads both sides from
the release; onboard/package/reader.py validates what the package holds before anything runs; report.py is
the AlignmentReport written to PKG/alignment/; progress.py reports each check group as it starts;
regression.py is `--check` against baseline.json; runner.py runs the tiers in order.
"""
from onboard.align.regression import read_baseline, regressions
from onboard.align.runner import run_alignment

__all__ = ["read_baseline", "regressions", "run_alignment"]
