"""The README's and docs' own links land: every relative link names a file that exists, every `#anchor` a heading of
that file (GitHub's slugs), and every code fence opens and closes on a line of its own."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "scripts").glob("*.md")])
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
