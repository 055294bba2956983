"""Which transformers class a release of a family loads with: the image-text-to-text model for
multimodal families (it holds the vision tower), the causal LM otherwise."""
from __future__ import annotations


def model_class(family: str):
    """The transformers class for config model_type `family`."""
    from transformers.models.auto import modeling_auto as auto

    if family in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return getattr(__import__("transformers"), auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[family])
    return getattr(__import__("transformers"), auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
