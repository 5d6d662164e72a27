"""The README's and docs' own links land: every relative link names a file that exists, every `#anchor` a heading of
that file (GitHub's slugs), and every code fence opens and closes on a line of its own."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "scripts").glob("*.md")])
LINK = re.compile(r"\]\(([^)\s]*)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # a '#' comment in a code block is no heading
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_slug_follows_github():
    assert slug("Serving (`inference/drafters/eagle3.py`, drafter type `eagle3`)") == \
        "serving-inferencedrafterseagle3py-drafter-type-eagle3"
    assert slug("The fp32 kernel: plain steps and trees on AVX2") == "the-fp32-kernel-plain-steps-and-trees-on-avx2"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_land(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_fences_stand_alone(page):
    lines = page.read_text().splitlines()
    inline = [i + 1 for i, line in enumerate(lines) if "```" in line and not line.lstrip().startswith("```")]
    fences = [line for line in lines if line.lstrip().startswith("```")]
    assert not inline, f"{page.relative_to(ROOT)}: a code fence inside a line of text at lines {inline}"
    assert len(fences) % 2 == 0, f"{page.relative_to(ROOT)}: a code block never closed"


def test_readme_and_docs_stay_a_users_manual():
    """The README says what to run within 30 lines and stays under 200; a docs page covers one topic in at most 400
    lines (measurement history goes to docs/experiments/, dated); none speaks of the place it was written in."""
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 200, f"README.md: {len(readme)} lines"
    first_command = next(i for i, line in enumerate(readme) if line.startswith(("pip ", "python ")))
    assert first_command < 30, f"README.md: the first command is on line {first_command + 1}"
    long = [f"{p.name}: {n}" for p in (ROOT / "docs").glob("*.md") if (n := len(p.read_text().splitlines())) > 400]
    assert not long, f"docs pages over 400 lines: {long}"
    notes = sorted((ROOT / "docs" / "experiments").glob("*.md"))
    undated = [p.name for p in notes if p.name != "README.md" and not re.match(r"\d{4}-\d\d-\d\d-", p.name)]
    assert notes and not undated, f"docs/experiments notes without a date: {undated}"
    index = (ROOT / "docs" / "experiments" / "README.md").read_text()
    assert not [p.name for p in notes if p.name != "README.md" and f"({p.name})" not in index], "a note not indexed"
    workplace = [f"{p.relative_to(ROOT)}:{i + 1}" for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
                 for i, line in enumerate(p.read_text().splitlines()) if re.search(r"session", line, re.I)]
    assert not workplace, f"pages that speak of sessions: {workplace}"
