"""PKG/.github/workflows/alignment.yml: the CI job rerunning `onboard align PKG --check` (templates/alignment.yml.j2).

The model's name in it (and in the `--git` branch) is a slug of the release folder's name (`model_slug`), so no
release-supplied text reaches YAML or a git ref unescaped.
"""
from __future__ import annotations

import re
from pathlib import Path

from onboard.gap.render import jinja_env

WORKFLOW = Path(".github") / "workflows" / "alignment.yml"


def model_slug(model_dir: Path) -> str:
    """The release folder's name in lower-case letters, digits, '.', '_' and '-' (no '..', no leading or trailing
    punctuation, no '.lock' ending: a valid git branch component); "model" when nothing is left."""
    slug = re.sub(r"\.{2,}", ".", re.sub(r"[^a-z0-9._-]+", "-", Path(model_dir).name.lower())).strip("-._")
    return slug.removesuffix(".lock").strip("-._") or "model"


def workflow_yaml(model: str, pkg_path: str = ".") -> str:
    """The workflow for the package at `pkg_path` of the repository it is committed to ("." when the package is
    the repository's root)."""
    return jinja_env().get_template("alignment.yml.j2").render(model=model, pkg=pkg_path)


def write_workflow(pkg: Path, model: str) -> None:
    path = Path(pkg) / WORKFLOW
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(workflow_yaml(model))
