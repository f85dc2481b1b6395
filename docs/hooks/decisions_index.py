"""docs/decisions/index.md lists every decision by number with its title and page.
The build fails (strict) while the list and the pages disagree, or a number is on two
pages; `python docs/hooks/decisions_index.py` writes the list again from the pages."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

log = logging.getLogger("mkdocs.plugins.decisions_index")
HERE = Path(__file__).resolve().parents[1] / "decisions"
ENTRY = re.compile(r"^## D(\d+)\. (.+)$", flags=re.M)
BEGIN, END = "<!-- every decision: begin -->", "<!-- every decision: end -->"


def anchor(heading: str) -> str:
    """The heading's anchor as GitHub and the site (pymdownx.slugs) both make it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def entries(folder: Path = HERE) -> list[tuple[int, str, str, str]]:
    """(number, title, page, page title) of every decision, by number."""
    found = []
    for page in sorted(folder.glob("*.md")):
        if page.name == "index.md":
            continue
        text = page.read_text()
        title = text.split("\n", 1)[0].removeprefix("# ").removeprefix("Decisions: ")
        for number, heading in ENTRY.findall(text):
            found.append((int(number), heading, page.name, title))
    return sorted(found)


def table(found: list[tuple[int, str, str, str]]) -> str:
    rows = ["| decision | title | page |", "|---|---|---|"]
    for number, heading, page, title in found:
        link = anchor(f"D{number}. {heading}")
        heading = heading.replace("|", r"\|")
        rows.append(f"| [D{number}]({page}#{link}) | {heading} | [{title}]({page}) |")
    return "\n".join(rows)


def problems(folder: Path = HERE) -> list[str]:
    found = entries(folder)
    numbers = [n for n, *_ in found]
    twice = sorted({n for n in numbers if numbers.count(n) > 1})
    out = [f"D{n} is on two pages" for n in twice]
    index = (folder / "index.md").read_text()
    listed = index.split(BEGIN, 1)[-1].split(END, 1)[0].strip()
    if listed != table(found):
        out.append("docs/decisions/index.md does not list the pages' decisions: "
                   "run python docs/hooks/decisions_index.py")  # fmt: skip
    return out


def write(folder: Path = HERE) -> None:
    index = folder / "index.md"
    head, rest = index.read_text().split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    index.write_text(f"{head}{BEGIN}\n{table(entries(folder))}\n{END}{tail}")


def on_pre_build(config):
    for problem in problems():
        log.warning(problem)


if __name__ == "__main__":
    write()
    sys.exit(0)
