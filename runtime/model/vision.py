"""The vision path of multimodal releases: the release's own vision tower (frozen, reused from
transformers: the one place the runtime calls it), image features scattered into the text
embeddings, and the 3-axis (time, height, width) positions of multimodal rope.

Shape legend: B batch, T tokens, D model width, P patches, N image features (P / merge^2).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from runtime.model.weights import shard_order


class VisionTower(nn.Module):
    """transformers' vision model for the release's vision_config, weights from the release, frozen."""

    def __init__(self, vision_config: dict, model_type: str):
        super().__init__()
        from transformers import AutoConfig, AutoModel

        config = AutoConfig.for_model(model_type, **{k: v for k, v in vision_config.items() if k != "model_type"})
        self.tower = AutoModel.from_config(config, trust_remote_code=False)
        self.merge = vision_config.get("spatial_merge_size", 2)
        self.requires_grad_(False)

    def load(self, model_dir: Path, prefix: str) -> None:
        state = {}
        for file, names in shard_order(Path(model_dir)).items():
            wanted = [n for n in names if n.startswith(prefix)]
            if wanted:
                with safe_open(Path(model_dir) / file, "pt") as shard:
                    state |= {n.removeprefix(prefix): shard.get_tensor(n) for n in wanted}
        self.tower.load_state_dict(state, strict=True)

    def forward(self, pixel_values_PX: torch.Tensor, grid_thw_N3: torch.Tensor) -> torch.Tensor:
        """features_ND: one row per merged patch, images concatenated in order."""
        return self.tower(pixel_values_PX.to(next(self.tower.parameters()).dtype), grid_thw=grid_thw_N3).pooler_output


def multimodal_positions(input_ids_BT: torch.Tensor, image_token_id: int, grid_thw_N3: torch.Tensor, merge: int) -> torch.Tensor:
    """positions_3BT: text tokens count up on all three axes; an image's tokens take (t, h, w) grid
    coordinates offset by the position reached, which then advances by the image's larger side."""
    B, T = input_ids_BT.shape
    positions = torch.zeros(3, B, T, dtype=torch.long)
    grids = iter(grid_thw_N3.tolist())
    for b in range(B):
        is_image = (input_ids_BT[b] == image_token_id).tolist()
        t, pos = 0, 0
        while t < T:
            run = _run_length(is_image, t)
            if not is_image[t]:
                positions[:, b, t:t + run] = torch.arange(pos, pos + run)
                pos, t = pos + run, t + run
                continue
            gt, gh, gw = next(grids)
            gh, gw = gh // merge, gw // merge
            tt, hh, ww = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
            positions[:, b, t:t + run] = torch.stack([tt, hh, ww]).reshape(3, -1)[:, :run] + pos
            pos, t = pos + max(gh, gw), t + run
    return positions.to(input_ids_BT.device)


def _run_length(flags: list[bool], start: int) -> int:
    end = start
    while end < len(flags) and flags[end] == flags[start]:
        end += 1
    return end - start


def multimodal_embeddings(embed_tokens: nn.Embedding, tower: VisionTower, input_ids_BT, pixel_values_PX, grid_thw_N3,
                          image_token_id: int) -> torch.Tensor:
    """inputs_embeds_BTD with image token rows replaced by the tower's features, in order."""
    embeds_BTD = embed_tokens(input_ids_BT)
    features_ND = tower(pixel_values_PX, grid_thw_N3).to(embeds_BTD.dtype)
    mask_BT = input_ids_BT == image_token_id
    if int(mask_BT.sum()) != features_ND.shape[0]:
        raise ValueError(f"{int(mask_BT.sum())} image tokens but the tower produced {features_ND.shape[0]} features")
    return embeds_BTD.masked_scatter(mask_BT[..., None], features_ND)
