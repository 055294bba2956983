"""Which transformers class a release of a family loads with: the image-text-to-text model for
multimodal families (it holds the vision tower), the causal LM otherwise."""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path


def model_class(family: str):
    """The transformers class for config model_type `family` (None when transformers does not know it)."""
    from runtime.model.own_modules import transformers_class

    return transformers_class(family)


@functools.lru_cache(maxsize=64)
def transformers_may_know(model_type: str) -> bool:
    """False only when transformers certainly does not know the family, found without importing transformers
    (which costs seconds, torch included): every model_type its model classes are mapped from is a string
    literal in the sources of transformers/models/auto/. True means "ask transformers itself"."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return False
    sources = list((Path(list(spec.submodule_search_locations)[0]) / "models" / "auto").glob("*.py"))
    literal = f'"{model_type}"'
    return not sources or any(literal in source.read_text() for source in sources)


def transformers_class_names() -> dict[str, str]:
    """family -> the transformers class a release of it loads with (image-text-to-text over causal LM)."""
    from runtime.model.own_modules import transformers_class_names as names

    return names()


def transformers_knows(family: str) -> bool:
    return transformers_may_know(family) and family in transformers_class_names()
