"""The documentation site (mkdocs.yml, `make docs`) builds in strict mode: every page of
docs/ is in the navigation, every internal link and anchor resolves, the README is its
home page, the API reference is generated from the served schema, and the search index
is built with it (no server, no network)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).with_name("mkdocs")
GENERATED = {"index.md", "api/reference.md"}  # docs/hooks/repository.py, openapi.py


def build(tmp: Path, docs: Path | None = None, nav: str = "") -> subprocess.CompletedProcess:
    config = ROOT / "mkdocs.yml"
    if docs is not None:  # the site's configuration on sources of the test's
        text = config.read_text().replace("docs_dir: docs", f"docs_dir: {docs}")
        text = text.replace("  - docs/hooks/", f"  - {ROOT}/docs/hooks/")
        text = text[: text.index("\nnav:\n")] + f"\nnav:\n{nav}"  # nav is the last key
        config = docs.parent / "mkdocs.yml"
        config.write_text(text)
    # The reference describes the deployment as `make docs` sees it, not the suite's settings.
    env = {k: v for k, v in os.environ.items()
           if k != "DJANGO_SETTINGS_MODULE" and not k.startswith("JOBS_")}  # fmt: skip
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "--config-file", str(config), "--site-dir",
         str(tmp / "site")],
        cwd=ROOT, env={**env, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def unsafe_yaml(path: Path) -> dict:
    """mkdocs.yml names Python objects (the slugify function): read it as MkDocs does."""
    from mkdocs.utils.yaml import get_yaml_loader

    with path.open() as f:
        return yaml.load(f, Loader=get_yaml_loader())


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs-site")
    done = build(tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr[-3000:]
    return tmp / "site"


def test_every_page_is_in_the_navigation_once():
    config = unsafe_yaml(ROOT / "mkdocs.yml")
    listed = nav_pages(config["nav"])
    assert len(listed) == len(set(listed)), "a page is listed twice"
    written = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert set(listed) == written | GENERATED, set(listed) ^ (written | GENERATED)


def test_the_site_builds_with_search_and_the_api_reference(site):
    home = (site / "index.html").read_text()
    assert "A 60-second walk-through" in home  # the README is the home page
    reference = (site / "api" / "reference.html").read_text()
    for operation in ("/api/v1/jobs/", "/api/v1/jobs/{id}/cancel/", "/api/v1/workflows/"):
        assert operation in reference, operation
    served = yaml.safe_load((site / "api" / "openapi.yaml").read_text())
    assert served["openapi"].startswith("3.") and "/api/v1/jobs/batch/" in served["paths"]
    index = json.loads((site / "search" / "search_index.json").read_text())
    locations = {doc["location"].split("#", 1)[0] for doc in index["docs"]}
    assert {"decisions/index.html", "performance/index.html", "api/reference.html"} <= locations
    # Every decision is found by its number.
    assert any(doc["title"].startswith("D77.") for doc in index["docs"])
    # Nothing is fetched from the network: no script, style sheet or font from another host.
    remote = re.compile(r'<(?:script|link)[^>]*(?:src|href)="(?:https?:)?//[^"]*"')
    for page in site.rglob("*.html"):
        assert not remote.findall(page.read_text()), page


def test_a_broken_link_an_anchor_or_a_page_outside_the_nav_fails_the_build(tmp_path):
    """The site's configuration (strictness, validation, hooks) on a site of three pages:
    the whole site's pages would only add a build's worth of rendering."""
    docs = tmp_path / "src" / "docs"
    docs.mkdir(parents=True)
    (docs.parent / "README.md").write_text("# jobservice\n\nThe [workers](docs/workers.md).\n")
    (docs / "tasks.md").write_text("# Adding a task\n\n## Retries\n")
    (docs / "stray.md").write_text("# Stray\n")
    (docs / "workers.md").write_text(
        "# Workers\n\n[retries](tasks.md#retries)\n"
        "\n[gone](missing.md) [no heading](tasks.md#no-such-heading) [code](../jobs/none.py)\n"
    )
    nav = "".join(f"  - {page}\n" for page in ("workers.md", "tasks.md", *sorted(GENERATED)))
    done = build(tmp_path, docs, nav)
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "stray.md" in out and 'not included in the "nav"' in out
    assert "'missing.md'" in out and "'#no-such-heading'" in out
    assert re.search(r"links to \.\./jobs/none\.py, which is not in the repository", out), out
    assert "#retries" not in out and "docs/workers.md" not in out, out  # only the breakages


def test_the_decisions_index_lists_every_decision():
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        import decisions_index
    finally:
        sys.path.remove(str(ROOT / "docs" / "hooks"))
    assert decisions_index.problems() == []
    numbers = [n for n, *_ in decisions_index.entries()]
    assert len(numbers) > 200 and numbers == sorted(set(numbers))
