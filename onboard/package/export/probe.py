"""The error a re-quantized merge costs, measured on a probe batch: our model with the adapter on the release's
stored weights (the path the run trained and was aligned on) against our model on the merged weights read back
from the exported folder, both through the package's weight map, in fp32.

Re-quantizing rounds every merged weight to its format's grid again, so the merged release is not the adapter
path exactly; the figure says by how much (relative RMS of the logits), and is written beside the weights. Both
models are the first PROBE_LAYERS decoder layers (the LM head on the last one's output; the whole model when it has
fewer), as alignment truncates large releases: a full-size release is never held twice in fp32.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime.lora.factors import LoraConfig, apply_lora, load_lora_state_dict

PROBE_BATCH, PROBE_TOKENS, PROBE_SEED, PROBE_LAYERS = 2, 32, 0, 4
REPORT = "merge_error.json"


def _load(spec: dict, weight_map: dict, source: Path, num_layers: int):
    """Our model of the release in `source` as train builds it (stored weights held as codes + scales), in fp32."""
    from runtime.model.stored import build_stored_model, stored_targets
    from runtime.model.weights import load_release

    model = build_stored_model(spec, stored_targets(weight_map), torch.device("cpu"), torch.float32, num_layers)
    vision = spec["naming"].get("vision_prefix")
    load_release(model, source, weight_map, skip_prefixes=(vision,) if vision else ())
    return model.eval()


def _with_biases(model, biases: dict[str, torch.Tensor]) -> None:
    """The run's updated router correction biases (runtime buffer name -> tensor), as the merge wrote them."""
    held = dict(model.named_buffers()) | dict(model.named_parameters())
    with torch.no_grad():
        for name, value in biases.items():
            held[name].copy_(value)


def merge_error(spec: dict, weight_map: dict, release: Path, merged: Path, config: LoraConfig,
                state: dict[str, torch.Tensor], biases: dict[str, torch.Tensor]) -> dict:
    """The probe's figures (also what REPORT holds)."""
    ids = torch.randint(0, spec["vocab_size"], (PROBE_BATCH, PROBE_TOKENS),
                        generator=torch.Generator().manual_seed(PROBE_SEED))
    num_layers = min(len(spec["layers"]), PROBE_LAYERS)
    adapter = _load(spec, weight_map, release, num_layers)
    apply_lora(adapter, config)
    held = set(dict(adapter.named_parameters())) | set(dict(adapter.named_buffers()))
    load_lora_state_dict(adapter, {n: v for n, v in state.items() if n in held})  # the prefix's factors
    _with_biases(adapter, {n: v for n, v in biases.items() if n in held})
    with torch.no_grad():
        expected = adapter(ids)
        del adapter
        actual = _load(spec, weight_map, merged, num_layers)(ids)
    diff = actual - expected
    return {
        "metric": "relative RMS of the logits: (merged - adapter) / adapter",
        "logits_rel_rms": (diff.pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item(),
        "logits_max_abs": diff.abs().max().item(),
        "probe": {"batch": PROBE_BATCH, "tokens": PROBE_TOKENS, "seed": PROBE_SEED, "dtype": "float32",
                  "layers": num_layers, "of_layers": len(spec["layers"])},
        "adapter_path": "our model with the adapter on the release's stored weights",
        "merged_path": "our model on the re-quantized merged weights read back from this folder",
    }


def write_report(out: Path, report: dict) -> None:
    (Path(out) / REPORT).write_text(json.dumps(report, indent=2) + "\n")
