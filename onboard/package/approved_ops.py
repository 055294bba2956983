"""The package op files this user approved: `$ONBOARD_STATE_DIR/approved_ops.json` (default
~/.local/share/onboard/), keyed by each file's sha256, with the file's name, the package it was in, when and
by what it was approved. Also package.yaml's `spec_steps` (what the graph changed after recognition: explanations
setting spec values, layers demoted to own modules), keyed by the sha256 of their JSON: they change what the
package computes, and a pull request could forge them together with a matching spec.json.

The approvals live with the user, not in the package: package.yaml travels inside a pull request, so a list
there could approve itself. package.yaml keeps the generated files' hashes only as a record for the reviewer.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from onboard.errors import BadInput

if TYPE_CHECKING:
    from runtime.package_ops import OpFile

STATE_ENV = "ONBOARD_STATE_DIR"
STORE_NAME = "approved_ops.json"


def state_dir() -> Path:
    configured = os.environ.get(STATE_ENV)
    return Path(configured) if configured else Path.home() / ".local" / "share" / "onboard"


def store_path() -> Path:
    return state_dir() / STORE_NAME


def approved_hashes() -> frozenset[str]:
    """The sha256 of every file approved so far (none before the first approval)."""
    return frozenset(_read(store_path()))


def require_approved(pkg: Path) -> None:
    """Refuse a package with an op file that is not loadable or not approved, or with spec steps not approved
    (exit 3 naming the file), before anything of it runs: what `train` and `bench` check first."""
    from runtime.errors import PackageOpRefused
    from runtime.package_ops import check_approved, read_op_files

    approved = approved_hashes()
    check_approved(Path(pkg), read_op_files(Path(pkg)), approved)
    digest = spec_steps_digest(Path(pkg))
    if digest is not None and digest not in approved:
        raise PackageOpRefused(Path(pkg) / "package.yaml", f"spec_steps are not approved: review them (PR.md lists "
                                                           f"them), then run `onboard approve {pkg}`")


def spec_steps_digest(pkg: Path) -> str | None:
    """sha256 of package.yaml's spec_steps as JSON (None when there are none, or no package.yaml to hold them)."""
    from onboard.package.files import read_manifest_file

    if not (Path(pkg) / "package.yaml").exists() and not (Path(pkg) / "package.yaml").is_symlink():
        return None
    steps = [step.model_dump() for step in read_manifest_file(pkg).spec_steps]
    return steps_digest(steps) if steps else None


def steps_digest(steps: list[dict]) -> str:
    return hashlib.sha256(json.dumps(steps, sort_keys=True).encode()).hexdigest()


def approve(entries: dict[str, str], pkg: Path, by: str) -> None:
    """Record sha256 -> file name (relative to the package) as approved, from `pkg`, by `by`."""
    at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = {sha: {"file": name, "package": str(Path(pkg).absolute()), "approved_by": by, "at": at}
              for sha, name in entries.items()}
    with _locked(store_path()) as path:
        _write(path, {**_read(path), **record})


def approve_files(files: list[OpFile], pkg: Path, by: str) -> list[OpFile]:
    """Approve the files that have bytes (regular files); returns them."""
    readable = [f for f in files if f.sha256 is not None]
    approve({f.sha256: f.path.relative_to(pkg).as_posix() for f in readable}, pkg, by)
    return readable


def _read(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise BadInput(path, None, f"the approved-ops store cannot be read ({err}); fix or remove it") from None
    approved = data.get("approved") if isinstance(data, dict) else None
    if not isinstance(approved, dict):
        raise BadInput(path, "approved", "expected an object of sha256 -> approval record; fix or remove the file")
    return approved


def _write(path: Path, approved: dict[str, dict]) -> None:
    """Atomically: a reader sees the old store or the new one, never half of it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"approved": approved}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[Path]:
    """Two approvals at once (two new-model runs) both land: read-modify-write under a lock beside the store."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(f".{path.name}.lock"), "a")
    except OSError as err:
        raise BadInput(path.parent, None, f"cannot write the approved-ops store there ({err.strerror or err})") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield path
