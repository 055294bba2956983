"""Which transformers class a release of a family loads with: the image-text-to-text model for
multimodal families (it holds the vision tower), the causal LM otherwise."""
from __future__ import annotations


def model_class(family: str):
    """The transformers class for config model_type `family` (None when transformers does not know it)."""
    from runtime.own_modules import transformers_class

    return transformers_class(family)
