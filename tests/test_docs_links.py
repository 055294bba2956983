"""The documentation a newcomer walks: every relative link in README.md, docs/*.md and bench/README.md reaches a
file of this repository (and, where it names an anchor, a heading of that page), the README stays short enough to
read in one sitting, and its test set-up command is the one CI runs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "bench" / "README.md", *(REPO / "docs").glob("*.md")])
README_MAX_LINES = 250

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`+[^`\n]*`+")  # `kernel[grid](...)` is code, not a link
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _links(page: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(page.read_text())) if not re.match(r"[a-z]+:", target)]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped (backticks, dots, slashes), spaces to hyphens; a
    repeated heading gets -1, -2, ..."""
    anchors, counts = set(), {}
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        anchors.add(slug if slug not in counts else f"{slug}-{counts[slug]}")
        counts[slug] = counts.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.is_relative_to(REPO) or not resolved.exists():
            broken.append(f"{target}: no such file in the repository")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_every_page_is_reached_from_the_readme():
    """A newcomer finds every page of docs/ and bench/README.md by following links from the README."""
    reached, todo = set(), [REPO / "README.md"]
    while todo:
        page = todo.pop()
        if page in reached or page.suffix != ".md" or not page.exists():
            continue
        reached.add(page)
        todo += [(page.parent / t.partition("#")[0]).resolve() for t in _links(page) if t.partition("#")[0]]
    assert not set(PAGES) - reached, f"not linked from any page: {sorted(map(str, set(PAGES) - reached))}"


def test_the_readme_is_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; details belong in docs/"


def test_ci_runs_the_readme_test_command():
    """.ci/run runs exactly the README's second set-up command, so a fresh clone tests what CI tests."""
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^    (\S.*&& python -m pytest.*)$", readme, re.MULTILINE)
    ci_lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert len(commands) == 1 and commands[0] == ci_lines[-1]
