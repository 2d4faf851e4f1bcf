"""The docs a reader follows (issue 64 item 4): every relative link of README.md and docs/ names a file the
repository has, and every "docs/design.md section N" a docstring or doc cites is a section design.md has, so that
moving a section or a page cannot leave a link to nothing."""

from __future__ import annotations

import re

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_every_relative_link_of_the_docs_names_a_file():
    broken = []
    for page in PAGES:
        for match in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            target = match.group(1)
            if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_every_cited_design_section_exists():
    """A citation "design.md section 3.2" or "design.md 6.7" in the package, the tools, the configs, the tests or the
    docs names one of design.md's sections (a "## N." heading or an "N.M **Title**" paragraph, "3.2b" included)."""
    design = (REPO / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (\d+)\.", design, re.M)) | set(re.findall(r"^(\d+\.\d+[a-z]?) \*\*", design, re.M))
    cited = []
    files = [*REPO.glob("pacs_jax/**/*.py"), *REPO.glob("tools/*.py"), *REPO.glob("configs/*.py"),
             *REPO.glob("tests/**/*.py"), *PAGES]
    for path in files:
        text = path.read_text()
        for match in re.finditer(r"design\.md(?:,? section| sections?)? (\d+(?:\.\d+[a-z]?)?)\b", text):
            cited.append((path, match.group(1)))
    missing = sorted({f"{p.relative_to(REPO)}: {n}" for p, n in cited if n not in sections})
    assert cited and not missing, missing
