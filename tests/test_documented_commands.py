"""Every documented command works as written: Makefile targets, README commands, --help.

Targets are discovered from the Makefile, so a new target is covered automatically;
the only ones not run are listed in SKIPPED with the test that covers them instead,
and the long ones run with their quickest options (QUICK).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from django.core.management import get_commands, load_command_class
from django.core.management.base import BaseCommand

from tests.harness import ROOT, database_url, free_port, wait_until

pytestmark = pytest.mark.slow

PY = str(Path(sys.executable))
SERVER = "postgres://root@127.0.0.1:5432"
CHECKOUT = re.sub(r"\W", "_", ROOT.name)[-20:]

# Targets never run here, each with what covers it.
SKIPPED = {
    "run": "runstack: test_make_run_with_several_workers starts it on free ports",
    "test": "this suite",
    "clean": "deletes the virtualenv the suite runs in",
    "chaos": "tests/test_chaos_short.py runs its command; test_recipe_matches_suite checks it",
    "bench": "tests/test_bench.py runs --quick; test_recipe_matches_suite checks the recipe",
    "table-growth": "tests/test_table_growth.py runs its quick size; test_recipe_matches_suite",
    "webhooks": "the suite runs its tests at 200 jobs; test_sized_target_runs_suite_tests",
    "schedules-long": "the suite runs its test for 25 s; test_sized_target_runs_suite_tests",
    "workflow-bench": "the suite runs its test at 100 nodes; test_sized_target_runs_suite_tests",
    "durable-loop": "the suite runs its test at 400 iterations; test_sized_target_runs_suite_tests",
    "fresh-project": "the suite runs its test with this checkout's dependencies; "
    "test_sized_target_runs_suite_tests",
    "test-matrix": ".ci/run runs it after make test; tests/test_packaging.py checks its cells",
    "test-long": ".ci/run runs it after make test; test_long_runs_are_what_make_test_leaves",
}
# The long targets' quickest options (table-health: 100 claims per phase, and the
# fewest queued jobs that allows).
QUICK = {
    "table-health": ["N=2000", "TABLE_HEALTH_ARGS=--claims 100 --queued 1000"],
    "archive-bench": ["N=2000"],
    "chaos-long": ["CHAOS_DURATION=8"],  # faults, the drain and every check still run
    # The positive cases only: the suite runs both modes itself (tests/api/test_fuzz.py).
    "fuzz": ["FUZZ_EXAMPLES=2", "FUZZ_ARGS=-k positive"],
    "crash-bench": ["CRASH_KILLS=1"],
    "workflow-linear": ["WORKFLOW_LINEAR_ARGS=--repeat 1"],
    "flow-batch": ["FLOW_BATCH_JOBS=300"],  # tests/test_flow_batches.py holds the rows
    "fillfactor": ["FILLFACTOR_JOBS=1000"],
}
# Targets that run tests of this suite at full size, by the variable those tests read.
SIZED = {
    "webhooks": "WEBHOOK_JOBS",
    "schedules-long": "SCHEDULE_E2E_SECONDS",
    "workflow-bench": "WORKFLOW_NODES",
    "durable-loop": "DURABLE_LOOP_TOTAL",
    "fresh-project": "FRESH_PROJECT_FULL",
}
# A skipped target whose recipe is exactly what another test runs.
SAME_AS_SUITE = {
    ("chaos",): ".venv/bin/python -m chaos --profile short",
    ("bench", "BENCH_ARGS=--quick"): ".venv/bin/python -m bench --quick",
    ("table-growth", "TABLE_GROWTH_JOBS=20000", "TABLE_GROWTH_ARGS=--quick"): (
        ".venv/bin/python -m bench --scenario table-growth --growth-jobs 20000 --quick"
    ),
}


def makefile_targets() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    return sorted(set(re.findall(r"^([a-z][\w-]*):(?![:?]?=)", text, flags=re.M)))


def test_targets_are_discovered():
    targets = makefile_targets()
    assert {"run", "test", "table-health", "migrate", "stop-db"} <= set(targets), targets
    assert not set(SKIPPED) - set(targets), "SKIPPED names a target that is gone"
    assert not set(QUICK) - set(targets), "QUICK names a target that is gone"


def dry_run(*args: str) -> list[str]:
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if line and "pip install" not in line]


def test_long_runs_are_what_make_test_leaves():
    """`make test` leaves the marker `long` out and `make test-long` runs exactly it; CI
    runs both, so a long run moved out of `make test` is still run on every submission."""
    test, long = dry_run("test")[-1], dry_run("test-long")[-1]
    assert '/pytest -m "not long" ' in test, test  # PYTEST_ARGS follow, as a caller sets them
    assert "/pytest -m long " in long, long
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci.index("make test") < ci.index("make test-long") < ci.index("make test-matrix")


def test_recipes_write_bytecode_whatever_the_environment_says(tmp_path):
    """D391: with PYTHONDONTWRITEBYTECODE=1 every process a recipe starts compiled the
    project again; the Makefile unexports it."""
    probe = tmp_path / "probe.mk"
    probe.write_text(
        f'include {ROOT / "Makefile"}\nprobe:\n\t@echo "[$$PYTHONDONTWRITEBYTECODE]"\n'
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run(["make", "-s", "-f", str(probe), "probe"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.strip() == "[]", out


@pytest.mark.parametrize("args", sorted(SAME_AS_SUITE), ids=" ".join)
def test_recipe_matches_suite(args):
    """A target skipped here runs exactly the command its own test runs."""
    assert dry_run(*args)[-1].strip() == SAME_AS_SUITE[args]


def sized_nodes(target: str) -> list[str]:
    """The test nodes `make -n <target>` names."""
    recipe = " ".join(dry_run(target)).replace("\\", " ")
    return re.findall(r"tests/\S+?\.py(?:::\w+)?", recipe)


@pytest.fixture(scope="module")
def collected() -> tuple[subprocess.CompletedProcess, list[str]]:
    """One `pytest --collect-only` of every sized target's nodes (one per target cost
    5-10 s each) and the test ids it listed."""
    nodes = sorted({node for target in SIZED for node in sized_nodes(target)})
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(
        [PY, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *nodes],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done, [line for line in done.stdout.splitlines() if line.startswith("tests/")]


@pytest.mark.parametrize("target", sorted(SIZED))
def test_sized_target_runs_suite_tests(target, collected):
    """A full-size target runs tests that exist, and sets the size they read."""
    recipe = " ".join(dry_run(target)).replace("\\", " ")
    size = SIZED[target]
    assert f"{size}=$(" not in recipe and f"{size}=" in recipe, recipe
    nodes = sized_nodes(target)
    assert nodes, recipe
    for node in nodes:
        assert size in (ROOT / node.split("::")[0]).read_text(), node
    done, ids = collected
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # Each node names one test: a function (one case of it), a file (its only test).
    mine = [i for i in ids for node in nodes
            if i == node or i.startswith((f"{node}::", f"{node}["))]  # fmt: skip
    assert len(mine) == len(nodes), (nodes, mine)


@pytest.fixture(scope="module")
def scratch_db():
    """A database name that does not exist yet (`make migrate` must create it)."""
    name = f"jobservice_smoke_{CHECKOUT}_{os.getpid()}"
    yield f"{SERVER}/{name}"
    subprocess.run(
        ["psql", "-h", "127.0.0.1", "-U", "root", "-d", "postgres", "-qc",
         f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"],
        check=False,
    )  # fmt: skip


@pytest.fixture
def embedded_pgdata():
    """A private embedded PostgreSQL data directory, never the checkout's var/pgdata.

    Not under pytest's tmp_path: the server runs as another user (pgserver) and any
    pytest session on the machine resets pytest-of-<user> to mode 0700 at its start.
    """
    parent = Path(tempfile.mkdtemp(prefix="jobs-embedded-"))
    parent.chmod(0o755)
    pgdata = parent / "pgdata"
    yield pgdata
    if pgdata.exists():  # stop a server the test left running, then delete it
        env = {**os.environ, "JOBS_EMBEDDED_PGDATA": str(pgdata)}
        subprocess.run([PY, "-m", "jobservice.embedded", "reset"], env=env, check=False)
    shutil.rmtree(parent, ignore_errors=True)


def embedded_env(pgdata: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL",)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return {**env, "JOBS_EMBEDDED_PGDATA": str(pgdata)}


def embedded_running(pgdata: Path) -> bool:
    out = subprocess.run(
        [PY, "-m", "jobservice.embedded", "status"],
        env=embedded_env(pgdata), capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return out.strip() == "running"


def start_embedded(pgdata: Path) -> None:
    """Any manage.py command without DATABASE_URL starts it, silently."""
    done = subprocess.run(
        [PY, "manage.py", "check"], cwd=ROOT, env=embedded_env(pgdata),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "XDG_RUNTIME_DIR" not in done.stderr and "Warning" not in done.stderr, done.stderr
    assert embedded_running(pgdata)


@pytest.mark.long
@pytest.mark.timeout(240)
@pytest.mark.parametrize("target", [t for t in makefile_targets() if t not in SKIPPED])
def test_make_target_runs(target, scratch_db, embedded_pgdata):
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["DATABASE_URL"] = scratch_db
    if target in ("stop-db", "reset-db"):
        start_embedded(embedded_pgdata)
        env = embedded_env(embedded_pgdata)
    started = time.monotonic()
    done = subprocess.run(
        ["make", target, *QUICK.get(target, [])], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=230,
    )  # fmt: skip
    took = time.monotonic() - started
    out = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"make {target}: exit {done.returncode}\n{out}"
    print(f"make {target}: {took:.1f}s")
    if target in ("stop-db", "reset-db"):
        assert not embedded_running(embedded_pgdata)
        assert embedded_pgdata.exists() == (target == "stop-db")


def test_make_migrate_creates_a_missing_database(scratch_db):
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    name = f"{scratch_db}_new"
    try:
        done = subprocess.run(
            ["make", "migrate"], cwd=ROOT, env={**env, "DATABASE_URL": name},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"database {name.rsplit('/', 1)[1]} created" in done.stdout
    finally:
        subprocess.run(
            ["psql", "-h", "127.0.0.1", "-U", "root", "-d", "postgres", "-qc",
             f"DROP DATABASE IF EXISTS {name.rsplit('/', 1)[1]} WITH (FORCE)"],
            check=False,
        )  # fmt: skip


HELP_ALL = """
import contextlib, io, json, sys
from django.core.management import ManagementUtility, get_commands
import django
django.setup()
failed = {}
for name in sorted(get_commands()):
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            ManagementUtility(["manage.py", name, "--help"]).execute()
        except SystemExit as exc:
            code = exc.code or 0
        except Exception as exc:  # noqa: BLE001 - reported below
            code = repr(exc)
    if code or "usage: manage.py " + name not in out.getvalue() or err.getvalue():
        failed[name] = [code, err.getvalue()[-500:]]
print(json.dumps({"commands": len(get_commands()), "failed": failed}))
"""


def test_every_manage_command_help_runs():
    """`manage.py <command> --help` for every command, Django's and ours (one process:
    each start costs a second or two on a loaded machine)."""
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env |= {"DATABASE_URL": f"{SERVER}/postgres", "DJANGO_SETTINGS_MODULE": "jobservice.settings"}
    done = subprocess.run(
        [PY, "-c", HELP_ALL], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["commands"] == len(get_commands()) > 30
    assert not report["failed"], report["failed"]


# runreaper still says some defaults in prose; left to its own change.
DEFAULTS_SHOWN = ("runworker", "runstack", "prunejobs", "slo", "ensuredb", "kafka")


@pytest.mark.parametrize("command", DEFAULTS_SHOWN)
def test_project_commands_show_their_defaults(command):
    """Every optional option that takes a value says its default in --help, as `[value]`."""
    parser = load_command_class("jobs", command).create_parser("manage.py", command)
    base = {a.dest for a in BaseCommand().create_parser("manage.py", "x")._actions}
    for action in parser._actions:
        if action.dest in base or action.required or action.nargs == 0:
            continue
        assert "[" in (action.help or "") and "]" in action.help, (command, action.dest)
    text = " ".join(parser.format_help().split())  # the help's line wrapping aside
    if command == "runworker":
        assert "[8 threads; 4 processes]" in text and "[default,webhooks]" in text
        assert "[10.0]" in text


def test_no_module_shadows_the_standard_library():
    """A script run from a directory puts it first on sys.path: a module named after a
    standard-library one (bench/http.py, jobs/logging.py) then breaks unrelated imports."""
    allowed = {
        # The project's name for the read layer; jobs/ is never on sys.path.
        "jobs/selectors.py",
        # `manage.py queue` (issue 19's name); Django imports it as jobs.management.commands.queue.
        "jobs/management/commands/queue.py",
    }
    shadowing = {
        str(p.relative_to(ROOT))
        for pkg in ("jobs", "jobservice", "chaos", "bench", "demo", "harness", "tests")
        for p in (ROOT / pkg).rglob("*.py")
        if p.stem in sys.stdlib_module_names and "migrations" not in p.parts
    }
    assert shadowing <= allowed, sorted(shadowing - allowed)


# --- docs/start.md, "Developing locally" ------------------------------------------

# Lines of the walk-through run by other tests here (they start servers on fixed ports
# or act on the checkout's own embedded database).
DEV_COVERED_ELSEWHERE = {
    "make run WORKERS=3": "test_make_run_with_several_workers",
    'make run RUN_ARGS="--bind 127.0.0.1:8001 --metrics-port 9501"': (
        "test_make_run_with_several_workers"
    ),
    "make stop-db": "test_make_target_runs[stop-db]",
    "make reset-db": "test_make_target_runs[reset-db]",
}


def page(path: str) -> str:
    """A page of the documentation, as written (docs/start.md, docs/tasks.md, ...)."""
    return (ROOT / path).read_text()


def python_files(section: str) -> dict[str, str]:
    """A page's Python blocks that start with `# path/to/file.py`."""
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return {b.split("\n", 1)[0][2:].strip(): b for b in blocks if re.match(r"# \w+/\w+\.py\n", b)}


def test_adding_a_task_snippets_define_every_name():
    """The task example compiles and names nothing it does not import or define."""
    files = python_files(page("docs/tasks.md"))
    assert set(files) == {"myapp/models.py", "myapp/tasks.py"}
    import builtins
    import symtable

    for path, source in files.items():
        table = symtable.symtable(source, path, "exec")
        defined = set(dir(builtins)) | {s.get_name() for s in table.get_symbols()
                                        if s.is_assigned() or s.is_imported()}  # fmt: skip
        for child in table.get_children():
            used = {s.get_name() for s in child.get_symbols() if s.is_global()}
            assert used <= defined, (path, sorted(used - defined))


@pytest.mark.timeout(300)
def test_readme_local_development_runs_as_written(tmp_path, scratch_db):
    section = page("docs/start.md")
    (script,) = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    lines = script.splitlines()
    assert set(DEV_COVERED_ELSEWHERE) <= set(lines)
    lines = [line for line in lines if line not in DEV_COVERED_ELSEWHERE]
    documented_db = "postgres://root@127.0.0.1:5432/jobservice_dev"
    assert any(documented_db in line for line in lines)
    # Run from a scratch directory (startapp writes there) against a scratch database.
    script = "\n".join(lines)
    for documented, here in [
        (documented_db, f"{scratch_db}_dev"),
        ("make install && . .venv/bin/activate",
         f"make -C {ROOT} install && . {ROOT}/.venv/bin/activate"),
        ("python manage.py", f"python {ROOT}/manage.py"),
        ("make migrate", f"make -C {ROOT} migrate"),
    ]:  # fmt: skip
        assert documented in script
        script = script.replace(documented, here)
    # The app files are written from the task page's own blocks right after startapp.
    files = python_files(page("docs/tasks.md"))
    writes = "\n".join(
        f"cat > {path} <<'README_EOF'\n{source}README_EOF" for path, source in files.items()
    )
    startapp = f"python {ROOT}/manage.py startapp myapp"
    assert startapp in script
    script = script.replace(startapp, f"{startapp}\n{writes}")
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = str(tmp_path)
    try:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=280,
        )  # fmt: skip
    finally:
        subprocess.run(
            ["psql", "-h", "127.0.0.1", "-U", "root", "-d", "postgres", "-qc",
             f"DROP DATABASE IF EXISTS {scratch_db.rsplit('/', 1)[1]}_dev WITH (FORCE)"],
            check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "created" in done.stdout  # the database did not exist before
    assert "Superuser created successfully." in done.stdout
    assert "Create model LedgerEntry" in done.stdout
    assert "Subject: Welcome!" in done.stdout  # the console mail backend
    assert "stopped after 2 job(s)" in done.stdout
    assert done.stdout.rstrip().endswith("1 ledger entry")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _metrics_ports(workers: int) -> list[int]:
    """A metrics base port whose derived ports (worker n: + 100 × (n - 1), the reaper:
    + 1) are all free now: on a shared machine a taken one stops the stack at start."""
    while True:
        base = free_port()
        ports = [base + 100 * n for n in range(workers)] + [base + 1]  # workers, reaper
        if all(p < 65536 and _bindable(p) for p in ports):
            return ports


def run_until_up_then_ctrl_c(env: dict[str, str], workers: int) -> tuple[str, list]:
    """`make run` with RUN_ARGS moving every port; once every process answers, Ctrl-C.
    Returns make's output and the processes it had started."""
    api, ports = free_port(), _metrics_ports(workers)
    stack: list[psutil.Process] = []
    make = subprocess.Popen(
        ["make", "run", f"WORKERS={workers}",
         f"RUN_ARGS=--bind 127.0.0.1:{api} --metrics-port {ports[0]}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )  # fmt: skip
    urls = [f"http://127.0.0.1:{api}/healthz"] + [f"http://127.0.0.1:{p}/metrics" for p in ports]
    try:
        # Also ends when make does (runstack stops when a child exits): fail with its output.
        wait_until(lambda: make.poll() is not None or all(_answers(u) for u in urls), 180,
                   "the stack to answer", interval=0.5)  # fmt: skip
        assert make.poll() is None, make.communicate(timeout=30)[0][-4000:]
        stack = psutil.Process(make.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in stack)
        assert names.count(" runworker ") == workers and names.count(" runreaper ") == 1, names
        os.killpg(make.pid, signal.SIGINT)  # Ctrl-C
        out, _ = make.communicate(timeout=60)
    finally:
        if make.poll() is None:  # a failure above: kill what this test started
            for p in [*psutil.Process(make.pid).children(recursive=True), make]:
                p.kill()
    gone, alive = psutil.wait_procs(stack, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert f"API on http://127.0.0.1:{api}/" in out and f"{workers} worker(s)" in out, out
    assert "exited with" not in out, out  # no child died on its own
    assert not any(_answers(u) for u in urls)
    return out, stack


@pytest.mark.timeout(240)
def test_make_run_with_several_workers(scratch_db):
    """`make run WORKERS=3`: three workers and the reaper serve metrics; Ctrl-C stops all."""
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    run_until_up_then_ctrl_c({**env, "DATABASE_URL": scratch_db}, workers=3)


@pytest.mark.timeout(240)
def test_make_run_stops_the_embedded_database_on_ctrl_c(embedded_pgdata):
    """Without DATABASE_URL, `make run` starts an embedded PostgreSQL and stops it again."""
    out, _ = run_until_up_then_ctrl_c(embedded_env(embedded_pgdata), workers=1)
    assert "embedded PostgreSQL: postgresql://postgres@/jobservice" in out, out
    assert "embedded PostgreSQL stopped" in out, out
    assert not embedded_running(embedded_pgdata)
    assert "XDG_RUNTIME_DIR" not in out, out


# --- every command the README shows -----------------------------------------------

# `manage.py jobs` verbs that act on job ids: the ids in the guides name no job here.
ON_ROWS = r"^python manage\.py jobs (show|retry|cancel|revoke|repair) "
# `manage.py sequence` verbs name a sequence key: the guide's names no sequence here.
ON_SEQUENCES = r"^python manage\.py sequence (show|resume|skip) "
# How each README command line is covered: run by a test named here, or why not.
README_COMMANDS = [
    (r"^make (run|test)$", "make run: test_make_run_with_several_workers; make test: this suite"),
    (r"^make \S+", "dry-run here; the target itself runs in test_make_target_runs"),
    (r"^python manage\.py (runworker|runreaper) .*--metrics-port", "run here on free ports"),
    (r"^python manage\.py (runreaper --once|slo --window)", "run here"),
    (r"^python manage\.py queue (pause|resume|list)\b", "run here"),
    (r"^python manage\.py jobs (list|purge)\b", "run here (purge finds no job to cancel)"),
    (ON_ROWS, "tests/test_jobs_command.py runs each verb on real rows, as a staff user"),
    (ON_SEQUENCES, "tests/test_flow_sequences.py runs each verb on a real sequence"),
    (r"^python manage\.py kafka (create-topic|status)\b", "run here against a broker"),
    (r"^python manage\.py outbox (list|start)\b", "run here"),
    (r"^manage\.py prunejobs ", "a synopsis: run here without brackets, --dry-run"),
    (r"^docker compose|^cp \.env\.example", "needs docker: tests/test_deploy_files.py"),
    (r"^python -m bench --quick", "tests/test_bench.py"),
    (r"^python -m bench ", "minutes per scenario: tests/test_bench.py runs them with --quick"),
    (r"^python -m bench\.request_cpu ", "tests/test_bench.py, with 2 rounds of 20 requests"),
    (
        r"^python -m bench\.plot_scaling ",
        "needs a scale run's results and make bench's matplotlib: docs/scaling.png is its output",
    ),
    (r"^\.venv/bin/python -m chaos --profile short", "tests/test_chaos_short.py (short profile)"),
]
SECTIONS_TESTED_AS_A_WHOLE = {
    "A 60-second walk-through": "tests/api/test_readme.py runs the walk-through",
}


# Where commands are documented: the README and every page of the documentation site.
DOCUMENTS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
DOCUMENTS_TESTED_AS_A_WHOLE = {
    "docs/django.md": "tests/test_fresh_project.py runs the page in a startproject project",
    "docs/start.md": "test_readme_local_development_runs_as_written",
}
# Sections of the guides whose commands other tests run, by (document, section title).
GUIDE_SECTIONS_TESTED_AS_A_WHOLE = {
    ("docs/operations.md", "Past one Postgres"): "tests/runbook.py: test_pgbouncer_e2e.py and "
    "test_replica_e2e.py run each check block against a real PgBouncer and replica",
}


def readme_commands() -> list[str]:
    parts = [
        (path, part)
        for path in DOCUMENTS
        if path not in DOCUMENTS_TESTED_AS_A_WHOLE
        for part in re.split(r"\n## ", (ROOT / path).read_text())
    ]
    commands = []
    for path, part in parts:
        if path == "README.md" and part.split("\n", 1)[0] in SECTIONS_TESTED_AS_A_WHOLE:
            continue
        if (path, part.split("\n", 1)[0]) in GUIDE_SECTIONS_TESTED_AS_A_WHOLE:
            continue
        for block in re.findall(r"```sh\n(.*?)```", part, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line and not line.startswith("#"):
                    commands.append(line)
    return commands


def test_every_readme_command_is_covered():
    commands = readme_commands()
    assert "make run" in commands and "python manage.py runreaper --once" in commands
    # The guides' commands are read too (deployment, retention, benchmark, fault suite).
    assert "docker compose up -d --build" in commands and "make chaos-long" in commands
    assert any(c.startswith("manage.py prunejobs ") for c in commands)
    assert any(c.startswith("python -m bench ") for c in commands)
    for command in commands:
        rule = next((why for pattern, why in README_COMMANDS if re.search(pattern, command)), None)
        assert rule, f"README command not covered by any test: {command!r}"


@pytest.mark.parametrize("command", [c for c in readme_commands() if c.startswith("make ")])
def test_readme_make_commands_parse(command):
    """Each `make ...` line names a target and variables the Makefile has (make -n)."""
    assert dry_run(*shlex.split(command)[1:])


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "command",
    [
        c
        for c in readme_commands()
        if re.match(r"^(python )?manage\.py ", c)
        and not re.match(ON_ROWS, c)
        and not re.match(ON_SEQUENCES, c)
    ],
)
def test_readme_manage_commands_run(command, request):
    args = shlex.split(re.sub(r"[\[\]]", "", command.removeprefix("python ")))
    ports = {}
    for i, arg in enumerate(args):
        if args[i - 1] == "--metrics-port":
            args[i] = ports.setdefault(arg, str(free_port()))
    if args[1] == "prunejobs":
        assert "--dry-run" in args
    env = {**os.environ, "DATABASE_URL": database_url()}
    if args[1] == "kafka":  # against a broker of its own
        broker = request.getfixturevalue("broker")
        env["JOBS_KAFKA_BOOTSTRAP_SERVERS"] = broker.bootstrap
    proc = subprocess.Popen(
        [PY, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    if ports:  # a long-running process: up when its metrics answer, then a clean stop
        try:
            url = f"http://127.0.0.1:{next(iter(ports.values()))}/metrics"
            wait_until(lambda: _answers(url) or proc.poll() is not None, 60, url, interval=0.2)
        finally:
            proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out


def test_the_readme_tasks_backend_settings_pass_check_and_agree_with_the_django_page():
    """The README's example named a queue its settings did not declare (jobs.E102) and
    listed an installed app's `tasks` module in JOBS_TASK_MODULES, which django.md
    rightly says is found without it."""
    from django.test import override_settings

    from jobs.backends import JobServiceBackend

    section = page("docs/django-tasks.md")
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", section, flags=re.S)
                  if b.startswith("# settings.py\n")]  # fmt: skip
    settings_part = example.split("\n# shop/tasks.py\n")[0]
    declared: dict = {}
    exec(settings_part, declared)  # the README's own settings lines
    tasks = declared["TASKS"]["default"]
    assert "emails" in tasks["QUEUES"]
    with override_settings(JOBS_QUEUES=declared.get("JOBS_QUEUES", {"default": {}})):
        backend = JobServiceBackend(alias="default", params=tasks)
        assert list(backend.check()) == []
    apps = [a for a in declared["INSTALLED_APPS"] if isinstance(a, str)]
    for doc in (section, (ROOT / "docs" / "django.md").read_text()):
        listed = re.findall(r"JOBS_TASK_MODULES\s*=\s*\[([^\]]*)\]", doc)
        found = {m.strip("\"' ") for group in listed for m in group.split(",")}
        assert not {f"{app}.tasks" for app in apps} & found, found  # discovered anyway
        for mention in re.findall(r"[^.]*JOBS_TASK_MODULES[^.]*", doc):
            assert "elsewhere" in mention or "outside" in mention, mention
