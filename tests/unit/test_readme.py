"""The README stays an entry: at most 300 lines, no wording about how the work was organised, links that resolve.

It grew from 233 to 602 lines once, with pass counts that needed a commit each time and phrases a reader cannot
follow ("stop 15's main", "this stop's chunk-loop fix"). Details belong in docs/; the README links to them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.launch import ROOT

README = ROOT / "README.md"
MAX_LINES = 300
ORGANISATION_WORDING = re.compile(r"\bstops? \d+|\bthis stop\b|\bstop's\b|\b\d+ (?:tests )?passed\b", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_is_an_entry():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES}): move details to docs/"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_no_wording_about_how_the_work_was_organised(page):
    found = [m.group(0) for m in ORGANISATION_WORDING.finditer(page.read_text())]
    assert not found, f"{page.relative_to(ROOT)}: {found}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_relative_links_resolve(page):
    missing = [
        target
        for target in LINK.findall(page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_the_wording_check_can_fail():
    assert ORGANISATION_WORDING.search("the suite on stop 15's main")
    assert ORGANISATION_WORDING.search("this stop's chunk-loop fix")
    assert ORGANISATION_WORDING.search("1201 passed")
    assert not ORGANISATION_WORDING.search("a SIGTERM stops the run; non-stop training")
