"""A multimodal release whose rope config does not say how the rotary pairs split over the position axes.

Its vision path gives the text model positions on three axes (time, height, width); a config without
`mrope_section` leaves the split to the model code's default. For a family transformers knows, its own
rotary module is then the oracle: run on one token whose three positions differ (1, 2, 3), each pair's angle divided by its
frequency says which axis drives it. The split is kept when it is one of the runtime's layouts
(contiguous sections or interleaved, runtime/ops/rope/torch_form.py), else the rope is not recognized.
"""
from __future__ import annotations

from onboard.release.config_view import NotRecognized
from onboard.release.manifest import Manifest


def _rotary_module(manifest: Manifest):
    """transformers' rotary module of the text decoder, built on the CPU (it holds only frequencies)."""
    from onboard.recognize.meta_check import _build_on_meta
    from runtime.model.own_modules import text_decoder

    meta = getattr(text_decoder(_build_on_meta(manifest)), "rotary_emb", None)
    return None if meta is None else type(meta)(meta.config)


def _axes(rotary, num_pairs: int) -> list[int]:
    import torch

    positions_3BT = torch.tensor([1, 2, 3]).reshape(3, 1, 1)
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, 1, 1), positions_3BT)
    angle_F = torch.atan2(sin[0, 0, :num_pairs].double(), cos[0, 0, :num_pairs].double())
    return (angle_F / rotary.inv_freq[:num_pairs].double()).round().long().sub(1).tolist()


def probed_mrope(manifest: Manifest, num_pairs: int, key: str) -> tuple[list[int], bool]:
    """(mrope_section, interleaved) as transformers' rotary module applies them; NotRecognized otherwise."""
    from runtime.ops.rope.torch_form import mrope_axes

    try:
        rotary = _rotary_module(manifest)
        axes = _axes(rotary, num_pairs) if rotary is not None else None
    except Exception as err:  # noqa: BLE001 (any failure of the probe: the split stays unknown)
        raise NotRecognized(key, f"no mrope_section, and transformers' rotary module could not be probed: {err}")
    if axes is not None and set(axes) <= {0, 1, 2}:
        section = [axes.count(axis) for axis in range(3)]
        for interleaved in (False, True):
            if mrope_axes(num_pairs, section, interleaved).tolist() == axes:
                return section, interleaved
    raise NotRecognized(key, f"no mrope_section, and transformers' rotary module drives the pairs by axes {axes}, "
                             "neither contiguous nor interleaved sections")
