"""Tier 2, vision path: an image + text input through our runtime (text model + the release's own frozen
vision tower + our multimodal positions) vs transformers' whole multimodal model."""
from __future__ import annotations

from pathlib import Path

import torch

from onboard.align.progress import Progress
from onboard.align.reference import load_reference, load_runtime
from onboard.align.release_code import ships_code
from onboard.align.report import Check
from onboard.align.tiers.tier2_model import logits_check
from runtime.model.vision import VisionTower, multimodal_embeddings, multimodal_positions
from runtime.spec import ModelSpec
from runtime.tolerances import compare, tolerance_for


def _image_input(spec: ModelSpec, vision_config: dict, seed: int):
    """One 8x8-patch image between two text runs: ids_BT, pixel values, grid, token types."""
    gen = torch.Generator().manual_seed(seed)
    merge, v = spec.vision.spatial_merge_size, spec.vision
    grid = torch.tensor([[1, 4 * merge // 2, 4 * merge // 2]])
    num_patches = int(grid.prod())
    channels = vision_config.get("in_channels", 3) * vision_config.get("temporal_patch_size", 2) * v.patch_size ** 2
    pixels = torch.randn(num_patches, channels, generator=gen)
    image_tokens = num_patches // merge**2
    text = lambda n: torch.randint(0, min(spec.vocab_size, v.image_token_id), (n,), generator=gen)
    ids = torch.cat([text(5), torch.full((image_tokens,), v.image_token_id), text(7)])[None]
    return ids, pixels, grid, (ids == v.image_token_id).int()


def vision_checks(spec: ModelSpec, weight_map: dict, source: Path, vision_config: dict, num_layers: int, seed: int = 3,
                  progress: Progress | None = None) -> list[Check]:
    progress = progress or Progress()
    progress.group("vision path")
    if spec.own_model:
        # the tower sits frozen inside transformers' whole model, which the runtime runs on text only
        return [Check(tier=2, name="vision/not-aligned", metric="none", value=0.0, tolerance=0.0, verdict="info",
                      detail="the model runs whole as transformers' own; the runtime trains its text path only, "
                             "the vision tower is loaded frozen and not compared")]
    if ships_code(source):
        # transformers' class of the family is not the release's model: never compared against it instead
        return [Check(tier=2, name="vision/not-aligned", metric="none", value=0.0, tolerance=0.0, verdict="info",
                      detail="the release ships its own code: the vision path is not compared with it yet (the "
                             "text path's tiers 1-2 are)")]
    ids, pixels, grid, token_types = _image_input(spec, vision_config, seed)
    ref = load_reference(source, spec.family, torch.float32, num_layers)
    ours = load_runtime(spec, weight_map, source, torch.float32, num_layers)
    tower = VisionTower(vision_config, spec.vision.model_type)
    tower.load(source, spec.naming.vision_prefix)
    with torch.no_grad():
        truth = ref(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=token_types,
                    use_cache=False).logits.float()
        embeds = multimodal_embeddings(ours.embed_tokens, tower, ids, pixels, grid, spec.vision.image_token_id)
        positions = multimodal_positions(ids, spec.vision.image_token_id, grid, spec.vision.spatial_merge_size)
        logits = ours(inputs_embeds_BTD=embeds, positions=positions)
        text_only = ours(inputs_embeds_BTD=embeds)
    tol = tolerance_for("model_logits", torch.float32)
    c, moved = compare(logits, truth, tol), compare(text_only, truth, tol)
    return [logits_check("vision/logits/float32", c, torch.float32),
            # guard: the image must matter, and so must its 3-axis positions
            Check(tier=2, name="vision/positions-matter", metric="max_abs_rel", value=moved.max_abs_rel,
                  tolerance=tol.max_abs_rel, verdict="pass" if moved.max_abs_rel > 10 * tol.max_abs_rel else "fail",
                  detail="logits with 1-D positions must differ from transformers' multimodal run")]
