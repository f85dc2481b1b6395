"""The site and the repository read the same Markdown: the README is the site's home
page, and a page's links to files outside docs/ (the code, the README) stay links on a
checkout. In the site such a link is checked here, that its file exists, and shown as its
text (the site has no copy of the code); a missing one fails the strict build."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.plugins.repository")
LINK = re.compile(r"(?<!!)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"(^```.*?^```)", flags=re.S | re.M)
HOME = "index.md"


def on_files(files, config):
    root = Path(config.config_file_path).resolve().parent
    files.append(File.generated(config, HOME, content=(root / "README.md").read_text()))
    return files


def on_page_markdown(markdown, page, config, files):
    root = Path(config.config_file_path).resolve().parent
    docs = Path(config.docs_dir).resolve()
    # The home page is the README: its links are relative to the repository's root.
    source = root / "README.md" if page.file.src_uri == HOME else docs / page.file.src_uri
    here = docs / page.file.src_uri

    def relink(match: re.Match) -> str:
        text, target = match.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve()
        if resolved == root / "README.md":
            resolved = docs / HOME
        if resolved.is_relative_to(docs) and resolved != docs:
            if resolved.is_dir():
                resolved = resolved / "index.md"
            rel = os.path.relpath(resolved, here.parent)
            return f"[{text}]({rel}{'#' + anchor if anchor else ''})"
        if not resolved.exists():
            log.warning("%s links to %s, which is not in the repository", page.file.src_uri, target)
        return text  # a file of the repository, not of the site

    parts = FENCE.split(markdown)
    return "".join(p if p.startswith("```") else LINK.sub(relink, p) for p in parts)
