"""The status new-model's alignment stage records, for packages the tests write with the package stage alone."""
from __future__ import annotations

from pathlib import Path

import yaml


def record_alignment_passed(pkg: Path) -> Path:
    """The package stage alone (write_package) leaves a package without gaps `ready-for-alignment`; new-model's
    alignment stage then records `trainable`, which `train` and `bench` require. Running tiers 0-2 for every
    fixture would cost minutes per family, so the fixtures record the status that stage records for these
    releases (tests/onboard/test_family_sweep.py, tests/onboard/test_package_files.py and the demo run the stage
    itself). A package with gaps keeps its status."""
    manifest = yaml.safe_load((pkg / "package.yaml").read_text())
    if manifest["status"] == "ready-for-alignment":
        manifest |= {"status": "trainable", "reasons": []}
        (pkg / "package.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return pkg
