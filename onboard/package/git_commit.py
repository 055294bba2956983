"""`new-model --git REPO`: the package committed into a git repository on a new branch `onboard/<model>`.

Plumbing only, so the user's checkout is never touched (HEAD, index, work tree, other branches): a
temporary index file is filled from the current HEAD's tree (when the repository has commits), the package
is added under `packages/<model>/` with its workflow also at `.github/workflows/onboard-<model>.yml` (where
GitHub runs it, pointed at that folder; the relative release path of package.yaml and of the reports rewritten
to hold from there),
then `write-tree`, `commit-tree` with PR.md as the message body,
and `update-ref` of the new branch with the zero id as the old value, so a branch that appeared meanwhile
is never overwritten.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import yaml

from onboard.errors import BadInput
from onboard.gap.render import gap_markdown
from onboard.gap.report import GapReport
from onboard.package.workflow import workflow_yaml

ZERO_ID = "0" * 40


def branch_for(model: str) -> str:
    return f"onboard/{model}"


def check_repo(repo: Path, model: str) -> None:
    """Before the graph runs: REPO is a git work tree and the branch is new (exit 2 otherwise)."""
    repo = Path(repo)
    if not repo.is_dir() or _git(repo, "rev-parse", "--is-inside-work-tree", check=False) != "true":
        raise BadInput(repo, "--git", "not a git work tree")
    branch = branch_for(model)
    if _git(repo, "check-ref-format", "--branch", branch, check=False) is None:
        raise BadInput(repo, "--git", f"{branch!r} is not a valid branch name")
    if _git(repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False) is not None:
        raise BadInput(repo, "--git", f"branch {branch} exists already; remove it or onboard into another repository")


def commit_package(repo: Path, pkg: Path, model: str, title: str) -> str:
    """The new branch's commit id; its message is `title`, a blank line and PR.md."""
    repo, pkg, prefix = Path(repo), Path(pkg), f"packages/{model}"
    check_repo(repo, model)
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **_identity(repo), "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        parent = _git(repo, "rev-parse", "--verify", "--quiet", "HEAD^{commit}", check=False)
        if parent is not None:
            _git(repo, "read-tree", parent, env=env)
            _git(repo, "rm", "--cached", "-r", "-q", "--ignore-unmatch", "--", prefix, env=env)
        rewritten = _rebased_files(pkg, repo / prefix)
        entries = [(path, f"{prefix}/{path.relative_to(pkg).as_posix()}") for path in sorted(pkg.rglob("*"))
                   if path.is_file() and path.relative_to(pkg).as_posix() not in rewritten]
        ids = _git(repo, "hash-object", "-w", "--stdin-paths", stdin="\n".join(str(p) for p, _ in entries) + "\n")
        lines = [f"{_mode(p)} {i}\t{name}" for (p, name), i in zip(entries, ids.splitlines())]
        for text, name in [*((text, f"{prefix}/{name}") for name, text in rewritten.items()),
                           (workflow_yaml(model, prefix), f".github/workflows/onboard-{model}.yml")]:
            lines.append(f"100644 {_git(repo, 'hash-object', '-w', '--stdin', stdin=text)}\t{name}")
        _git(repo, "update-index", "--index-info", stdin="\n".join(lines) + "\n", env=env)
        tree = _git(repo, "write-tree", env=env)
        message = f"{title}\n\n{(pkg / 'PR.md').read_text()}"
        commit = _git(repo, "commit-tree", tree, *(["-p", parent] if parent else []), "-F", "-", stdin=message, env=env)
    _git(repo, "update-ref", f"refs/heads/{branch_for(model)}", commit, ZERO_ID)
    return commit


def _rebased_files(pkg: Path, dest: Path) -> dict[str, str]:
    """package.yaml and the reports that name the release relative to the package, rewritten to hold from `dest`."""
    files = {"package.yaml": _manifest_in_repo(pkg, dest)}
    for name, key in (("gap_report.json", ("model", "source")), ("alignment/report.json", ("source",)),
                      ("alignment/baseline.json", ("source",))):
        if (pkg / name).is_file():
            files[name] = _rebased_json(pkg, dest, name, key)
    if "gap_report.json" in files:
        files["gap_report.md"] = gap_markdown(GapReport.model_validate_json(files["gap_report.json"]))
    return files


def _rebased_json(pkg: Path, dest: Path, name: str, key: tuple[str, ...]) -> str:
    data = json.loads((pkg / name).read_text())
    holder = data
    for part in key[:-1]:
        holder = holder[part]
    release = (pkg / holder[key[-1]]).resolve()
    holder[key[-1]] = os.path.relpath(release, dest.resolve())
    return json.dumps(data, indent=2)


def _manifest_in_repo(pkg: Path, dest: Path) -> str:
    """package.yaml with `source.path` relative to where the package lands in the repository (a checkout of
    the branch beside the release then finds it as the package folder did)."""
    manifest = yaml.safe_load((pkg / "package.yaml").read_text())
    release = (pkg / manifest["source"]["path"]).resolve()
    manifest["source"]["path"] = os.path.relpath(release, dest.resolve())
    return yaml.safe_dump(manifest, sort_keys=False)


def _mode(path: Path) -> str:
    return "100755" if os.access(path, os.X_OK) else "100644"


def _identity(repo: Path) -> dict[str, str]:
    """The repository's configured identity, or onboard's own when it has none (a fresh CI machine)."""
    if _git(repo, "config", "user.email", check=False):
        return {}
    return {"GIT_AUTHOR_NAME": "onboard", "GIT_AUTHOR_EMAIL": "onboard@localhost",
            "GIT_COMMITTER_NAME": "onboard", "GIT_COMMITTER_EMAIL": "onboard@localhost"}


def _git(repo: Path, *args: str, stdin: str | None = None, env: dict | None = None, check: bool = True) -> str | None:
    """stdout stripped; None when the command fails and check is off; a failure with check on is exit 2 naming it."""
    done = subprocess.run(["git", "-C", str(repo), *args], input=stdin, capture_output=True, text=True, env=env)
    if done.returncode == 0:
        return done.stdout.strip()
    if not check:
        return None
    raise BadInput(repo, "--git", f"git {args[0]} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
