"""The README and the guides in docs/ link to files and headings that exist, so moving a
section between them cannot leave a dead link behind. This reads them as a checkout shows
them; tests/test_docs_site.py builds the site from the same files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Pages the site generates when it is built (docs/hooks/openapi.py): links to them are
# checked by the site's strict build, not here.
GENERATED = {ROOT / "docs" / "api" / "reference.md"}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def dead_links(document: Path) -> list[str]:
    dead = []
    for target in LINK.findall(re.sub(r"```.*?```", "", document.read_text(), flags=re.S)):
        if re.match(r"^[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        if linked in GENERATED:
            continue
        if not linked.exists():
            dead.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            dead.append(target)
    return dead


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(document):
    assert not dead_links(document)


def test_the_readme_links_every_guide():
    readme = (ROOT / "README.md").read_text()
    for guide in ("operations", "performance/index", "fault-suite", "architecture", "overview",
                  "api", "start", "django", "decisions/index"):  # fmt: skip
        assert f"](docs/{guide}.md" in readme, guide


def test_a_dead_link_is_found(tmp_path):
    (tmp_path / "guide.md").write_text("# Guide\n\n## Metrics and alerts\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](guide.md) [ok](guide.md#metrics-and-alerts) [web](https://example.org/x)\n"
        "[gone](missing.md) [no heading](guide.md#scaling)\n"
        "```sh\n[in code](ignored.md)\n```\n"
    )
    assert dead_links(page) == ["missing.md", "guide.md#scaling"]
