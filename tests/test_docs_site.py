"""The documentation: README.md short enough to read at once, docs/ a site that builds.

``mkdocs build --strict`` runs with the mkdocs of this interpreter (the ``test``
extra installs it), so a missing mkdocs fails here rather than skipping. mkdocs.yml
turns a page left out of ``nav:``, and a link to a missing page or heading, into
warnings, which ``--strict`` makes errors; two tests plant each in a copy and see
the build fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers_traces import REPO

README_MAX_LINES = 260
# Material for MkDocs prints a banner about MkDocs 2.0 on every build unless told not to.
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--site-dir", str(site)],
                          cwd=root, env=ENV, capture_output=True, text=True, timeout=300)


def site_copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(REPO / "docs", root / "docs")
    return root


def test_the_site_builds_strict(tmp_path):
    proc = build(REPO, tmp_path / "site")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_page_is_in_the_nav():
    """Said by mkdocs too (strict); here it names the page without a build."""
    nav = (REPO / "mkdocs.yml").read_text()
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, re.M))
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert pages == listed, (sorted(pages - listed), sorted(listed - pages))


@pytest.mark.parametrize("page, text, named", [
    ("orphan_page.md", "# An orphan\n\nIn no nav.\n", "orphan_page.md"),   # left out of nav
    ("index.md", "\nSee [a page](no-such-page.md).\n", "no-such-page.md"),  # a broken link
    ("index.md", "\nSee [a heading](tour.md#no-such-heading).\n", "no-such-heading"),
])
def test_a_page_out_of_the_nav_or_a_broken_link_fails_the_build(tmp_path, page, text, named):
    root = site_copy(tmp_path)
    path = root / "docs" / page
    path.write_text((path.read_text() if path.exists() else "") + text)
    proc = build(root, tmp_path / "site")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert named in proc.stdout + proc.stderr


def test_the_readme_fits_on_a_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; at most {README_MAX_LINES}: move detail to docs/")


def _slug(heading: str) -> str:
    """The anchor of a heading, as mkdocs (Python-Markdown's toc) and GitHub make it."""
    from markdown.extensions.toc import slugify
    return slugify(heading, "-")


def _anchors(page: Path) -> set[str]:
    out, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            out.add(_slug(line.lstrip("#").strip()))
    return out


def test_the_readme_s_links_into_docs_resolve():
    """mkdocs checks the pages' own links; the README's into docs/ are checked here."""
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", text)
    assert links, "the README links no docs page"
    for path, anchor in links:
        target = REPO / path
        assert target.is_file(), f"README.md links {path}, which does not exist"
        if anchor:
            assert anchor in _anchors(target), f"README.md links {path}#{anchor}: no such heading"
