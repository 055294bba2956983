"""The release's weight files as `new-model` read them: size and sha256 per shard, recorded in package.yaml's
`source.shards` and verified before anything loads a tensor, so weights changed, swapped or truncated after
`new-model` are refused instead of trained. A release without shard files (a config and index only) records
none and is verified against none: the commands that read tensor data stop before they need them.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from onboard.errors import BadInput
from onboard.release.manifest import Manifest

CHUNK = 8 * 2**20
# a line on stderr per shard this size or more: hashing a large release takes minutes, not a silent pause
PROGRESS_BYTES = 2**30


class ShardRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: NonNegativeInt
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


def shard_records(manifest: Manifest) -> dict[str, dict]:
    """shard file -> {size, sha256}, every shard present in the release (none when it ships none)."""
    if not manifest.shards_present:
        return {}
    return {file: _record(manifest.root / file).model_dump() for file in manifest.shard_files}


def _record(path: Path) -> ShardRecord:
    size = path.stat().st_size
    if size >= PROGRESS_BYTES:
        print(f"hashing {path} ({size / 2**30:.1f} GiB)", file=sys.stderr, flush=True)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return ShardRecord(size=size, sha256=digest.hexdigest())


def verify_shards(manifest: Manifest, recorded: dict[str, ShardRecord], package_yaml: Path) -> None:
    """Each shard the release holds now is one new-model recorded, with the same size and sha256."""
    present = set(manifest.shard_files) if manifest.shards_present else set()
    for file in sorted(present - set(recorded)):
        raise BadInput(package_yaml, f"source.shards.{file}",
                       "missing: the release holds this shard but `onboard new-model` recorded no hash of it")
    for file in sorted(set(recorded) - present):
        raise BadInput(manifest.root / file, None, "missing: `onboard new-model` read this shard of the release")
    for file in sorted(present):
        path, want = manifest.root / file, recorded[file]
        size = path.stat().st_size
        got = ShardRecord(size=size, sha256=want.sha256) if size != want.size else _record(path)
        if got != want:
            what = f"{size} bytes, {want.size} recorded" if size != want.size else "its sha256 differs from the one recorded"
            raise BadInput(path, None, f"changed since `onboard new-model` read it ({what} in {package_yaml.name}: "
                                       "source.shards); run `onboard new-model` again for this release")
