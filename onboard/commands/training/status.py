"""`train` and `bench` run a package only when new-model left it `trainable` (no gaps, alignment passed): a package
with gaps would be built and fail deep inside (an op with no kernel, a weight nothing loads), and one whose
alignment failed would train numbers nobody checked. Refused at once, exit 3, with package.yaml's own reasons."""
from __future__ import annotations

from pathlib import Path

TRAINABLE = "trainable"


class NotTrainable(Exception):
    """A valid package new-model did not leave trainable: exit 3 with this one line."""


def require_trainable(pkg: Path) -> None:
    from onboard.package.files import load_yaml, read_manifest_file

    manifest = read_manifest_file(Path(pkg))
    if manifest.status == TRAINABLE:
        return
    # `reasons` is a key the graph adds beside the schema's (package.yaml allows more keys)
    reasons = load_yaml(Path(pkg), "package.yaml").get("reasons") or []
    reasons = [str(r) for r in reasons] if isinstance(reasons, list) else [str(reasons)]
    why = f": {reasons[0]}" + (f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else "") if reasons else ""
    raise NotTrainable(f"{Path(pkg) / 'package.yaml'}: status {manifest.status!r}, not {TRAINABLE!r}{why}; "
                       f"{Path(pkg) / 'PR.md'} and gap_report.md say what is open")
