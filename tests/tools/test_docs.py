"""The docs' own gates: every page fits a reader (no page over 600 lines, one topic a page),
every relative link in them lands on a file and, with an anchor, on a heading of that file, and
results are text, CSV, JSON and plots that read in a diff, never archives."""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_LINES = 600
LINK = re.compile(r"\]\(([^)\s]+)\)")
ARCHIVES = (".tgz", ".tar", ".gz", ".xz", ".bz2", ".zip", ".zst")


def pages() -> list[pathlib.Path]:
    found = [ROOT / "README.md", *ROOT.joinpath("docs").rglob("*.md"), *ROOT.joinpath("pushkv").rglob("*.md"),
             *ROOT.joinpath("deploy").rglob("*.md"), *ROOT.joinpath("experiments").rglob("*.md")]
    return sorted(p for p in found if p.is_file())


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower())
    return text.replace(" ", "-")


def broken_links(page: pathlib.Path) -> list[str]:
    bad = []
    for mo in LINK.finditer(page.read_text()):
        target = mo.group(1)
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md":
            heads = {slug(line) for line in dest.read_text().splitlines() if line.startswith("#")}
            if anchor not in heads:
                bad.append(f"{target}: no such heading")
    return bad


def test_the_pages_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in pages()}
    assert {"README.md", "docs/design.md", "docs/design/transfer.md"} <= names


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_is_short_and_its_links_land(page: pathlib.Path):
    lines = page.read_text().count("\n")
    assert lines <= MAX_LINES, f"{page.relative_to(ROOT)} has {lines} lines (a page is one topic: split it)"
    assert broken_links(page) == []


def test_a_broken_link_is_caught(tmp_path: pathlib.Path):
    (tmp_path / "b.md").write_text("# Title here\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#title-here) [gone](c.md) [no heading](b.md#other)\n")
    assert broken_links(page) == ["c.md: no such file", "b.md#other: no such heading"]


def test_no_archive_in_the_docs():
    found = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.joinpath("docs").rglob("*")
                   if p.is_file() and p.name.endswith(ARCHIVES))
    assert found == [], f"summarise these as text or CSV (experiments/results_csv.py): {found}"
