"""Routed experts per MoE layer, whichever way the layer runs: a recognized MoE by its spec, a layer or FFN run as
its own module by the expert indices of its released tensors (`...experts.N...`), so that reports count the
experts of a release whose MoE the runtime does not compute."""
from __future__ import annotations

import re

from onboard.release.config_view import ConfigView, NotRecognized
from onboard.release.manifest import Manifest
from runtime.spec import ModelSpec, own_tensors

EXPERT_INDEX_RE = re.compile(r"(?:^|\.)experts\.(\d+)\.")
# the keys recognition reads experts per token and shared experts from (recognizer.moe)
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk")
SHARED_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")


def experts_per_layer(spec: ModelSpec) -> dict[int, int]:
    """Layer index -> routed experts, for every layer with any."""
    counts = {}
    for layer in spec.layers:
        if layer.ffn.kind == "moe":
            counts[layer.index] = layer.ffn.num_experts
            continue
        indices = {m.group(1) for name in own_tensors(layer.ffn) if (m := EXPERT_INDEX_RE.search(name))}
        if indices:
            counts[layer.index] = len(indices)
    return counts


def declared_routing(manifest: Manifest) -> tuple[int, int]:
    """(experts per token, shared experts) as the text config declares them; 0 where it does not."""
    view = ConfigView(manifest.text_config, str(manifest.root / "config.json"), "")
    try:
        return (view.positive_int(*TOP_K_KEYS, default=0, allow_zero=True),
                view.positive_int(*SHARED_KEYS, default=0, allow_zero=True))
    except NotRecognized:
        return 0, 0
