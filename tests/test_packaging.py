"""The wheel and sdist, up to the upload (they stay unpublished): only the `jobs` package,
metadata that installs on every supported Python and Django, the optional libraries as
extras, classifiers that name the matrix `make test-matrix` runs, a version the CHANGELOG
describes, and `twine check --strict` passing on both files."""

from __future__ import annotations

import email.parser
import importlib.util
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
import trove_classifiers
from packaging.requirements import Requirement

from tests.test_fresh_project import source_copy

ROOT = Path(__file__).resolve().parents[1]

# One group under `--dist loadgroup`: the module's wheel and sdist are built once, not
# once on each worker.
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("packaging")]

BUILD = """
import sys
from setuptools import build_meta
out = sys.argv[1]
print(build_meta.build_wheel(out))
print(build_meta.build_sdist(out))
"""


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """Both files, built without isolation (seconds) from a clean copy of the sources."""
    tmp = tmp_path_factory.mktemp("dist")
    src = source_copy(tmp / "src")
    out = tmp / "out"
    out.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", BUILD, str(out)],
        cwd=src, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def wheel_of(dist: Path) -> Path:
    (wheel,) = dist.glob("jobservice-*.whl")
    return wheel


def metadata(dist: Path):
    with zipfile.ZipFile(wheel_of(dist)) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(z.read(name).decode())


def test_the_wheel_holds_the_jobs_app_alone(dist):
    with zipfile.ZipFile(wheel_of(dist)) as z:
        tops = {n.split("/")[0] for n in z.namelist()}
        names = z.namelist()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert tops == {"jobs", f"jobservice-{version}.dist-info"}, tops
    # Its code, migrations, templates and static files, every one.
    sources = {
        str(f.relative_to(ROOT))
        for f in (ROOT / "jobs").rglob("*")
        if f.suffix in (".py", ".html", ".css", ".js") and "__pycache__" not in f.parts
    }
    assert sources - set(names) == set()
    assert any(n.startswith("jobs/migrations/0001") for n in names)
    with tarfile.open(next(dist.glob("jobservice-*.tar.gz"))) as t:
        packages = {Path(n).parts[1] for n in t.getnames() if len(Path(n).parts) > 2}
    assert "jobs" in packages and "jobservice" not in packages, packages


def test_twine_check_passes_on_the_wheel_and_the_sdist(dist):
    files = sorted(str(p) for p in dist.iterdir())
    assert len(files) == 2, files
    done = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *files],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED") == 2, done.stdout


def requirements(meta) -> list[Requirement]:
    return [Requirement(r) for r in meta.get_all("Requires-Dist")]


def test_the_optional_libraries_are_extras(dist):
    meta = metadata(dist)
    assert meta["Requires-Python"] == ">=3.11"
    assert set(meta.get_all("Provides-Extra")) >= {
        "kafka", "archive", "server", "otel", "sentry", "deploy", "tasks-backport"
    }  # fmt: skip
    plain = {r.name.lower(): r for r in requirements(meta) if r.marker is None}
    assert str(plain["django"].specifier) == "<6.2,>=5.2"
    for name in ("confluent-kafka", "pyarrow", "granian", "gunicorn", "django-tasks",
                 "opentelemetry-api", "opentelemetry-sdk", "sentry-sdk"):  # fmt: skip
        assert name not in plain, f"{name} is installed without its extra"

    def needed(name: str, **env: str) -> bool:
        return any(
            r.name.lower() == name and (r.marker is None or r.marker.evaluate(env))
            for r in requirements(meta)
        )

    for python in ("3.11", "3.12", "3.13"):
        bare = {"python_version": python, "extra": ""}
        assert not needed("confluent-kafka", **bare) and not needed("pyarrow", **bare)
        # Django 6 needs 3.12: on 3.11 a Tasks framework comes only from the backport.
        assert needed("django-tasks", **bare) == (python == "3.11")
        assert needed("django-tasks", python_version=python, extra="tasks-backport")
    for extra, name in (("kafka", "confluent-kafka"), ("archive", "pyarrow"),
                        ("server", "granian"), ("otel", "opentelemetry-sdk"),
                        ("otel", "opentelemetry-exporter-otlp-proto-http"),
                        ("sentry", "sentry-sdk")):  # fmt: skip
        assert needed(name, python_version="3.12", extra=extra), extra
    # `make install` (deploy,dev) brings every feature the full suite exercises.
    deploy = [r for r in requirements(meta) if r.marker and r.marker.evaluate({"extra": "deploy"})]
    (itself,) = [r for r in deploy if r.name == "jobservice"]
    assert itself.extras == {"kafka", "archive", "server", "otel", "sentry"}
    for module in ("confluent_kafka", "pyarrow", "granian", "opentelemetry.sdk", "sentry_sdk"):
        assert importlib.util.find_spec(module), f"make install did not install {module}"


def test_the_classifiers_are_known_and_name_every_cell_of_the_matrix(dist):
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile
    finally:
        sys.path.remove(str(ROOT))
    classifiers = metadata(dist).get_all("Classifier")
    unknown = [c for c in classifiers if c not in trove_classifiers.classifiers]
    assert not unknown, unknown
    named = {
        c.rsplit(" :: ", 1)[1]
        for c in classifiers
        if re.fullmatch(r"(Programming Language :: Python|Framework :: Django) :: \d+\.\d+", c)
    }
    cells = set(noxfile.CELLS)
    assert named == {p for p, _ in cells} | {d for _, d in cells}, named
    assert {p for p, _ in cells} == {"3.11", "3.12", "3.13"}
    assert {d for _, d in cells} == {"5.2", "6.0", "6.1"}
    assert not {(p, d) for p, d in cells if d.startswith("6") and p == "3.11"}  # no such Django
    assert len(cells) == 7


def test_the_changelog_describes_this_version(dist):
    version = metadata(dist)["Version"]
    heading = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert heading and heading.group(1) == version, "CHANGELOG.md's newest entry"


def test_ci_runs_the_matrix_after_the_suite():
    lines = [x.strip() for x in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert lines.index("make test-matrix") > lines.index("make test")
    listed = subprocess.run(
        [str(Path(sys.executable).with_name("nox")), "-l"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.count("* contract(py") == 7, listed.stdout
    assert ".nox/" in (ROOT / ".gitignore").read_text().splitlines()
