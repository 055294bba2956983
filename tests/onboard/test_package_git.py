"""`new-model --git REPO` against real `git init` repositories: the package lands on a new branch
onboard/<model> with PR.md as the message body, the user's HEAD, index and work tree untouched; a folder
that is not a work tree, or a branch that exists, is exit 2 with one line before anything runs."""
from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from onboard.package.files import read_source, release_folder
from onboard.package.git_commit import commit_package


def git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    """A repository with one commit, a modified tracked file and a staged new one."""
    repo = tmp_path / "repo"
    git(tmp_path, "init", "-q", "-b", "main", str(repo))
    git(repo, "config", "user.name", "Reviewer")
    git(repo, "config", "user.email", "reviewer@example.com")
    (repo / "README").write_text("ours\n")
    git(repo, "add", "README")
    git(repo, "commit", "-q", "-m", "init")
    (repo / "README").write_text("ours, edited\n")
    (repo / "staged.txt").write_text("staged\n")
    git(repo, "add", "staged.txt")
    return repo


def _user_state(repo) -> tuple[str, str, str, str]:
    return (git(repo, "rev-parse", "HEAD"), git(repo, "symbolic-ref", "HEAD"), git(repo, "status", "--porcelain"),
            git(repo, "diff", "--cached"))


def test_the_package_lands_on_its_own_branch_and_nothing_else_moves(onboarded_package, repo):
    _, pkg = onboarded_package
    before = _user_state(repo)
    commit = commit_package(repo, pkg, "qwen3_next", "onboard qwen3_next: trainable")
    assert _user_state(repo) == before and (repo / "README").read_text() == "ours, edited\n"
    assert git(repo, "rev-parse", "onboard/qwen3_next").strip() == commit
    assert git(repo, "rev-parse", f"{commit}^") == before[0]  # on top of the user's HEAD
    message = git(repo, "log", "-1", "--format=%B", commit)
    assert message.startswith("onboard qwen3_next: trainable\n\n") and (pkg / "PR.md").read_text().strip() in message
    files = set(git(repo, "ls-tree", "-r", "--name-only", commit).split())
    expected = {f"packages/qwen3_next/{p.relative_to(pkg).as_posix()}" for p in pkg.rglob("*") if p.is_file()}
    assert expected <= files and "README" in files and "staged.txt" not in files
    workflow = git(repo, "show", f"{commit}:.github/workflows/onboard-qwen3_next.yml")
    assert "PKG: packages/qwen3_next" in workflow
    committed = yaml.safe_load(git(repo, "show", f"{commit}:packages/qwen3_next/package.yaml"))
    ours = yaml.safe_load((pkg / "package.yaml").read_text())
    assert {**committed, "source": {**committed["source"], "path": None}} == \
        {**ours, "source": {**ours["source"], "path": None}}
    # the reports name the release as the committed package.yaml does, from where the package lands
    for name in ("alignment/report.json", "alignment/baseline.json"):
        assert json.loads(git(repo, "show", f"{commit}:packages/qwen3_next/{name}"))["source"] == \
            committed["source"]["path"]
    gap = git(repo, "show", f"{commit}:packages/qwen3_next/gap_report.json")
    assert json.loads(gap)["model"]["source"] == committed["source"]["path"]
    assert f"Source: `{committed['source']['path']}`" in git(repo, "show", f"{commit}:packages/qwen3_next/gap_report.md")


def test_a_checkout_of_the_branch_finds_the_release(onboarded_package, repo, tmp_path):
    _, pkg = onboarded_package
    commit_package(repo, pkg, "qwen3_next", "onboard qwen3_next: trainable")
    checkout = tmp_path / "checkout"
    git(repo, "worktree", "add", "-q", str(checkout), "onboard/qwen3_next")
    landed = checkout / "packages" / "qwen3_next"
    assert release_folder(landed, read_source(landed), None) == release_folder(pkg, read_source(pkg), None)


def test_new_model_git_commits_an_exit_3_package_then_refuses_the_same_branch(index_only_gap_release, onboard_cli,
                                                                               repo, tmp_path):
    first = onboard_cli("new-model", index_only_gap_release, "--out", tmp_path / "pkg", "--git", repo)
    assert first.code == 3 and "on branch onboard/mixtral-no-expert-3" in first.out, first.err
    message = git(repo, "log", "-1", "--format=%B", "onboard/mixtral-no-expert-3")
    assert message.startswith("onboard mixtral-no-expert-3: gaps or alignment open\n\n# Onboard MixtralForCausalLM")
    again = onboard_cli("new-model", index_only_gap_release, "--out", tmp_path / "pkg2", "--git", repo)
    assert again.code == 2 and again.err.strip() == (f"onboard: error: {repo}: --git: branch onboard/mixtral-no-expert-3 "
                                                     "exists already; remove it or onboard into another repository")
    assert not (tmp_path / "pkg2").exists()


def test_a_folder_that_is_not_a_work_tree_is_refused_before_the_run(index_only_gap_release, onboard_cli, tmp_path):
    result = onboard_cli("new-model", index_only_gap_release, "--out", tmp_path / "pkg", "--git", tmp_path)
    assert result.code == 2 and result.err.strip() == f"onboard: error: {tmp_path}: --git: not a git work tree"
    assert not (tmp_path / "pkg").exists()


def test_a_repository_without_commits_gets_a_root_commit(onboarded_package, tmp_path):
    _, pkg = onboarded_package
    git(tmp_path, "init", "-q", str(tmp_path / "empty"))
    commit = commit_package(tmp_path / "empty", pkg, "qwen3_next", "onboard qwen3_next: trainable")
    assert git(tmp_path / "empty", "rev-list", "--count", commit).strip() == "1"
