"""The model's own code for a module, as text for an LLM prompt: never imported or executed from the release.

Where config.json's `auto_map` names the release's `modeling_*.py`, that file is read as text and the classes
whose names end like the module's (e.g. `...TopkRouter` for the router) are cut out of its syntax tree; else,
for a family transformers knows, the same classes of transformers' modeling module (inspect.getsource).
The text is capped, and fenced with more backticks than it contains, so it cannot close its code block.
"""
from __future__ import annotations

import ast
import inspect
import json
import re
from pathlib import Path
from typing import Optional

from pydantic import BaseModel

MAX_CHARS = 24_000
# registry op -> endings of the class names that implement it, most specific first
CLASS_ENDINGS = {"moe_router": ("TopkRouter", "TopKRouter", "Router", "Gate"),
                 "moe_experts": ("Experts", "SparseMoeBlock", "MoeBlock", "MoE"), "swiglu_mlp": ("MLP",),
                 "rms_norm": ("RMSNorm",), "rope": ("RotaryEmbedding",), "gated_delta": ("GatedDeltaNet",)}


class ModelSource(BaseModel):
    origin: str  # "release modeling_x.py: XRouter" or "transformers.models.x.modeling_x: XRouter"
    text: str  # capped
    fence: str  # a backtick run longer than any in `text`


def module_source(model_dir: Path, family: str, op: str) -> Optional[ModelSource]:
    """The code of the classes implementing registry op `op`: the release's own, else transformers'."""
    endings = CLASS_ENDINGS.get(op, ())
    release_file = auto_map_file(Path(model_dir))
    if release_file is not None:
        found = _release_classes(release_file, endings)
        whole = {"(whole file)": release_file.read_text(errors="replace")}
        return fenced(f"release {release_file.name}", found or whole)
    found = _transformers_classes(family, endings)
    return fenced(found.pop("__module__"), found) if found else None


# the auto_map entries naming a release's own model class, in the order they are looked for
MODEL_ENTRIES = ("AutoModelForCausalLM", "AutoModel")


def model_entry(config: dict) -> Optional[str]:
    """The auto_map entry naming the release's own model class (`modeling_x.Class`), None when it ships none."""
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, dict):
        return None
    entry = next((auto_map[key] for key in MODEL_ENTRIES if key in auto_map), None)
    # a tokenizer-style [slow, fast] pair is not a model class
    return entry if isinstance(entry, str) else None


def auto_map_file(model_dir: Path) -> Optional[Path]:
    """The release's modeling file that config.json's auto_map names (a local `module.Class` entry)."""
    config = json.loads((model_dir / "config.json").read_text())
    for target in (config.get("auto_map") or {}).values():
        target = target[0] if isinstance(target, list) else target
        # "repo--module.Class" points at another repository's code, which is not in the release folder
        if isinstance(target, str) and "--" not in target and "." in target:
            path = model_dir / f"{target.rsplit('.', 1)[0]}.py"
            if path.name.startswith("modeling") and path.is_file():
                return path
    return None


def _release_classes(path: Path, endings: tuple[str, ...]) -> dict[str, str]:
    text = path.read_text(errors="replace")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {}
    classes = {node.name: ast.get_source_segment(text, node) for node in tree.body if isinstance(node, ast.ClassDef)}
    return _matching(classes, endings)


def _transformers_classes(family: str, endings: tuple[str, ...]) -> dict[str, str]:
    from onboard.release.transformers_classes import model_class

    cls = model_class(family)
    if cls is None or not endings:
        return {}
    module = inspect.getmodule(cls)
    classes = {name: obj for name, obj in vars(module).items() if inspect.isclass(obj) and obj.__module__ == module.__name__}
    found = {name: inspect.getsource(classes[name]) for name in _matching(classes, endings)}
    return {"__module__": module.__name__, **found} if found else {}


def _matching(classes: dict, endings: tuple[str, ...]) -> dict:
    """The classes with the first ending any of them has (the router's, not every `Gate` of the file)."""
    for ending in endings:
        found = {name: value for name, value in classes.items() if name.endswith(ending)}
        if found:
            return found
    return {}


def fenced(where: str, classes: dict[str, str]) -> ModelSource:
    """The classes' code, capped, with the fence that keeps it one code block."""
    text = "\n\n".join(classes.values())
    if len(text) > MAX_CHARS:
        text = text[:MAX_CHARS] + f"\n# ... cut at {MAX_CHARS} characters\n"
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return ModelSource(origin=f"{where}: {', '.join(classes)}", text=text, fence="`" * max(3, longest + 1))


def config_doc(family: str, key: str) -> Optional[str]:
    """What transformers' config class for the family says about `key`: its docstring entry and any alias
    (attribute_map) it is read through; None when transformers does not know the family or says nothing."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family not in CONFIG_MAPPING:
        return None
    cls = CONFIG_MAPPING[family]
    lines = []
    aliases = getattr(cls, "attribute_map", None) or {}
    if key in aliases:
        lines.append(f"{cls.__name__}.attribute_map reads {key!r} as {aliases[key]!r}")
    lines += _doc_entry(inspect.getdoc(cls) or "", aliases.get(key, key))
    return "\n".join(lines) or None


def _doc_entry(doc: str, key: str) -> list[str]:
    """The `key (type):` entry of an Args docstring and its indented description."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith(f"{key} (")), None)
    if start is None:
        return []
    indent = len(lines[start]) - len(lines[start].lstrip())
    entry = [lines[start].strip()]
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        entry.append(line.strip())
    return [" ".join(part for part in entry if part)]
