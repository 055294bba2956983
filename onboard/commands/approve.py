"""`onboard approve PKG`: record the sha256 of every file under PKG/ops/ as approved by this user, after review.

Approvals live in the user's store (onboard/package/approved_ops.py), never in the package: a pull request cannot
approve itself. align and train run a package's op files in this process only when every one is approved.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from onboard.errors import BadInput, printable
from onboard.exit_codes import Exit


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pkg")


def run(args) -> Exit:
    from onboard.package.approved_ops import approve, approve_files, spec_steps_digest, store_path
    from runtime.package_ops import read_op_files

    pkg = Path(args.pkg)
    if not pkg.is_dir():
        raise BadInput(pkg, None, "not a package folder")
    files = read_op_files(pkg)
    approved = approve_files(files, pkg, by="onboard approve")
    for f in files:
        state = f"sha256 {f.sha256}" if f in approved else "not approved"
        note = f" ({f.problem}; it will not load)" if f.problem else ""
        print(printable(f"{f.path}: {state}{note}"))
    digest = spec_steps_digest(pkg)
    if digest is not None:
        approve({digest: "package.yaml:spec_steps"}, pkg, by="onboard approve")
        print(printable(f"{pkg / 'package.yaml'}: spec_steps sha256 {digest}"))
    print(f"approved {len(approved)} file(s) of {pkg / 'ops'}{' and the spec steps' if digest else ''} in {store_path()}")
    return Exit.OK
