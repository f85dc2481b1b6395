"""The import rules of docs/architecture.md, read from the source with `ast`.

Every module of `jobs` sits in one layer and imports only from layers below it, so the
lifecycle rules stay at the bottom and nothing runs back up. Imports inside functions
and under `TYPE_CHECKING` count like any other: they are dependencies all the same.
A rule this code breaks today is listed in KNOWN_EXCEPTIONS with the reason, not hidden.
"""

from __future__ import annotations

import ast
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("jobs", "jobservice", "harness", "tests", "bench", "chaos", "demo")

# Lowest first. A module of `jobs` may import modules of lower layers only; in the
# entry-point layer also modules of its own package (jobs.api.*, jobs.admin.*).
LAYERS: list[tuple[str, list[str]]] = [
    # Every setting of the app and its default (imports nothing of the project).
    ("settings", ["jobs.conf"]),
    # The optional dependencies: which extra a feature needs, and its refusal (reads
    # the settings that turn the features on).
    ("optional dependencies", ["jobs.extras"]),
    # A task's retry policy and the two exceptions that override it (jobs.tasks uses them).
    ("retry policy", ["jobs.retries"]),
    # Import nothing of the project: the lifecycle's states and transitions, metric
    # definitions, the task registry, pure helpers. Empty package markers live here too.
    ("leaves", [
        "jobs", "jobs.lifecycle", "jobs.metrics", "jobs.errors", "jobs.exceptions",
        "jobs.logconfig", "jobs.queues", "jobs.tasks", "jobs.tasks_compat", "jobs.dispatch",
        "jobs.templatetags", "jobs.templatetags.*", "jobs.management",
        "jobs.management.commands", "jobs.schedules", "jobs.schedules.timing",
        "jobs.watchdog", "jobs.flow",
        # The OpenTelemetry and Sentry calls, each guarded (jobs.observability).
        "jobs.observability", "jobs.observability.context", "jobs.observability.tracing",
        "jobs.observability.errors",
    ]),
    # The logging filter that puts the trace and the running job on every line.
    ("log fields", ["jobs.observability.logs"]),
    # @periodic: what a declaration runs, resolved through the task registry (D223).
    ("task declarations", ["jobs.schedules.periodic"]),
    # Talk to the outside world; transport is the only module that imports redis.
    ("infrastructure", ["jobs.transport", "jobs.runtime", "jobs.reloading", "jobs.events.signing",
                        "jobs.events.ssrf", "jobs.events.deadline", "jobs.events.exchange",
                        # the read replica: where reads that may lag go (D147)
                        "jobs.replica",
                        # PostgreSQL's infinite dates as Python values (D158)
                        "jobs.pgtypes",
                        # the API process's connections, lent per request (D238)
                        "jobs.lending",
                        # Parquet files of archived periods: the only pyarrow import
                        "jobs.archive.files"]),
    # Whether the outbox is a batch behind, as the reaper's relays say and the workers'
    # deliveries ask (a Redis flag, D409).
    ("outbox backlog", ["jobs.events.backlog"]),
    # The models in rooms by capability (D401): first the job, its client and history,
    # which every other room points at; then the others, each importing only that one;
    # then the package's face, the one place callers import a model from.
    ("job models", ["jobs.models.jobs"]),
    ("model rooms", ["jobs.models.queues", "jobs.models.flow", "jobs.models.schedules",
                     "jobs.models.durable", "jobs.models.events"]),
    ("models", ["jobs.models", "jobs.graph", "jobs.flow.triggers"]),
    # Caches of model rows that the writes keep honest (the API clients by token hash).
    # jobs.waiting: one Redis subscription per process wakes the callers waiting on a job.
    ("model caches", ["jobs.clientcache", "jobs.waiting"]),
    # The rules of a submission's flow fields (debounce, key strategy, rate), which
    # jobs.validation asks with the rest of a job's rules.
    ("flow field rules", ["jobs.flow.rules"]),
    # What a submission is checked against before anything is written: the rules of one
    # job (jobs.validation) and admission (jobs.admission): the room in its queue, its
    # client's share of it, and a client's quotas, read (and its row locked) in the
    # guarded write of a schedule, a webhook or a signal (D372).
    ("submission checks", ["jobs.validation", "jobs.admission"]),
    # Rates per concurrency key counted in jobs_keyhit: the claim's and the submission's.
    ("per-key rates", ["jobs.flow.keyrate"]),
    # Every write, one compare-and-set each, in rooms that follow the job's life (issue
    # 43). First what they share: the lease, a finished row, how a statement runs, and
    # the Redis wake-ups sent once a write commits (and the park when one fails) (D399).
    ("service statements", ["jobs.services.common"]),
    # The claim's three ways: plain (and by id), then turns (fair share and keys), then
    # limited (under the queue's lock), each built on the one below.
    ("plain claim", ["jobs.services.claims", "jobs.services.claims.plain"]),
    ("claim in turns", ["jobs.services.claims.turns"]),
    ("service rooms", ["jobs.services.claims.limited", "jobs.services.inserts",
                       "jobs.services.fencing", "jobs.services.recovery",
                       "jobs.services.repairs", "jobs.services.retention",
                       "jobs.services.waits", "jobs.services.workflows"]),
    # The services' one face (what callers import) and every read.
    # jobs.partitions: partitions ahead and the mover (D163), the reaper's.
    # jobs.gauges: the readings behind the exported gauges.
    # jobs.flow.retention: the reaper's pass over the per-key rows (D361).
    ("services and selectors", ["jobs.services", "jobs.selectors", "jobs.gauges",
                                "jobs.partitions", "jobs.flow.retention"]),
    # What the pipeline calls around submissions, attempts, steps and outgoing calls: the
    # spans and error reports of jobs.observability (reads a job's trace context).
    ("observability hooks", ["jobs.observability.hooks"]),
    # Staff repairs (admin actions and `manage.py jobs`) and the Python cancel, each a
    # service call with its audit.
    ("staff and caller controls", ["jobs.staff", "jobs.cancelling", "jobs.flow.sequences"]),
    # One pass of the reaper's repairs (the reaper is the process that paces them).
    ("recovery sweeps", ["jobs.sweeps"]),
    # Retention by partition, the PostgreSQL side: periods, DETACH, DROP, ATTACH.
    ("archive tables", ["jobs.archive.tables"]),
    # A schedule's slots: the scheduler_runs row and the job it makes, in one statement.
    ("schedule firing", ["jobs.schedules.firing"]),
    # Flow control at submission: debounce, and what a new job does when its key is busy.
    ("flow control at submission", ["jobs.flow.debounce", "jobs.flow.strategies"]),
    ("flow pipeline", ["jobs.flow.pipeline"]),
    # Queue controls: the Queue rows synced from JOBS_QUEUES and a worker's view of them.
    # jobs.events: publish()/@subscriber; the Redis stream; the Kafka sink; endpoints'
    # slots and circuit breakers. jobs.starts: a worker's started marks (prefetched
    # attempts, D77).
    ("pipeline and presence", ["jobs.submission", "jobs.presence", "jobs.queuecontrol",
                               "jobs.events", "jobs.events.streams", "jobs.events.kafka",
                               "jobs.events.circuit", "jobs.starts"]),
    # The webhooks fan-out's write: a batch's delivery rows and their jobs (D262).
    ("webhook fan-out", ["jobs.events.fanout"]),
    # The outbox's reads: its sources, their rows as events and the bodies every sink
    # sends (jobs.events.sources); read binary, built once per reaper for its dispatchers
    # (D270, D380).
    ("outbox reads", ["jobs.events.reads", "jobs.events.sources"]),
    # Around the outbox's loop (D402): the webhooks relay (its subscriber that fans events
    # out to deliveries), where a subscriber's cursor is placed, how far each is behind.
    ("outbox relay, cursors and lag", ["jobs.events.relay", "jobs.events.cursors",
                                       "jobs.events.lag"]),
    # An endpoint's slots as a delivery process holds them (D240): it shares them out by
    # the live delivery workers (jobs.presence).
    ("endpoint slots", ["jobs.events.endpoints"]),
    # An endpoint's due deliveries in runs on a slot a delivery holds (D260): claimed,
    # called and written back a batch at a time.
    ("endpoint runs", ["jobs.events.batches"]),
    # Schedules held to the submission rules of the jobs they make.
    ("schedule definitions", ["jobs.schedules.define"]),
    # A durable job's parts (issue 45): what handlers raise; then replay and history,
    # waits, continue-as-new and the after-end hooks, one concern each; then the
    # context that mixes them.
    ("durable errors", ["jobs.durable.errors"]),
    ("durable parts", ["jobs.durable.history", "jobs.durable.waits", "jobs.durable.chain",
                       "jobs.durable.hooks"]),
    ("durable context", ["jobs.durable.context"]),
    # Durable jobs (steps, waits) and workflows: built on the services and the pipeline.
    ("durable jobs and workflows", ["jobs.durable", "jobs.workflows", "jobs.signals",
                                    "jobs.flow.batches"]),
    # The worker's rooms (issue 27): what they share, then one concern each, as mixins
    # of jobs.worker.Worker.
    ("worker attempts", ["jobs.worker.attempts"]),
    # The process pool: a child's side, then the pools both implementing Pool.
    ("worker pool child", ["jobs.worker.pools.child"]),
    ("worker pools", ["jobs.worker.pools.threads", "jobs.worker.pools.processes"]),
    ("worker rooms", ["jobs.worker.*"]),
    # The webhook delivery task parks a delivery its endpoint cannot take (a durable wait).
    # jobs.archive.*: retention by partition (prunejobs) and reading the archive back.
    ("processes", ["jobs.worker", "jobs.reaper", "jobs.schedules.scheduler",
                   "jobs.events.outbox", "jobs.events.webhooks",
                   "jobs.archive.retention", "jobs.archive.restore"]),
    # Bridges to frameworks around the processes: Django Tasks, Prometheus scrapes, checks.
    # jobs.deliveries: runworker's second worker, for webhook deliveries.
    # jobs.archive: archive_expired for scripts and benchmarks.
    ("adapters", ["jobs.backends", "jobs.collectors", "jobs.checks", "jobs.deliveries",
                  "jobs.archive"]),
    ("entry points", [
        # apps: its ready() wires the client cache's signal receivers in.
        # metrics_urls: the web process's /metrics, an include of its own (docs/django.md).
        "jobs.apps", "jobs.api", "jobs.api.*", "jobs.admin", "jobs.admin.*", "jobs.health",
        "jobs.metrics_urls", "jobs.management.commands.*",
        # testing: run_jobs (a worker driven in a test's thread) and its pytest fixture.
        "jobs.testing", "jobs.testing.*",
    ]),
]  # fmt: skip
ENTRY_PACKAGES = ("jobs.api", "jobs.admin", "jobs.testing")

# Imports that break a rule today, each with why; the test fails once one is gone, so
# the list only shrinks.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()

# Third-party modules only one module of the product (jobs, jobservice) may import; the
# harness, tests, bench and chaos drive them directly.
OWNED_IMPORTS = {
    "redis": {"jobs.transport"},
    "confluent_kafka": {"jobs.events.kafka"},
    "pyarrow": {"jobs.archive.files"},
    # The deployment configures the SDK and the Sentry client (jobservice.observability).
    "opentelemetry": {"jobs.observability.tracing", "jobservice.observability", "jobservice.wsgi"},
    "sentry_sdk": {"jobs.observability.errors", "jobservice.observability"},
}

# What the packages around `jobs` must never import.
FORBIDDEN = {
    "jobs": ("harness", "tests", "bench", "chaos", "demo", "jobservice"),
    "jobservice": ("harness", "tests", "bench", "chaos", "demo"),
    "harness": ("jobs", "jobservice", "tests", "bench", "chaos", "demo"),
    "bench": ("tests", "chaos"),
    "chaos": ("tests", "bench"),
    "demo": ("harness", "tests", "bench", "chaos"),
}
# The one module of jobservice that jobs may use: `runstack` starts the embedded
# PostgreSQL, which imports nothing of jobs. Settings are read through jobs.conf.
JOBS_MAY_IMPORT = {"jobservice.embedded"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports(module: str, source: str, is_package: bool = False) -> set[str]:
    """Every module `source` imports, absolute; `from pkg import mod` names pkg.mod."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: None if is_package else -1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if is_module(sub) else base)
    return found


def project_modules(package: str) -> dict[str, Path]:
    return {
        module_name(p): p
        for p in sorted((ROOT / package).rglob("*.py"))
        if "migrations" not in p.parts
    }


def layer_of(module: str) -> int | None:
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatchcase(module, pattern) for pattern in patterns):
            return index
    return None


def violations(module: str, targets: set[str]) -> list[str]:
    """What `module` imports against the rules, as `module -> target: why` lines."""
    top = module.split(".")[0]
    found = []
    for target in sorted(targets):
        target_top = target.split(".")[0]
        if (module, target) in KNOWN_EXCEPTIONS:
            continue
        owners = OWNED_IMPORTS.get(target_top)
        if owners is not None and top in ("jobs", "jobservice") and module not in owners:
            found.append(f"{module} -> {target}: only {sorted(owners)} may import {target_top}")
        if target_top in FORBIDDEN.get(top, ()):
            if not (top == "jobs" and target in JOBS_MAY_IMPORT):
                found.append(f"{module} -> {target}: {top} never imports {target_top}")
            continue
        if top != "jobs" or target_top != "jobs" or target == module:
            continue
        mine, theirs = layer_of(module), layer_of(target)
        if mine is None or theirs is None:
            continue  # reported by test_every_jobs_module_has_a_layer
        same_package = any(
            f"{module}.".startswith(f"{p}.") and f"{target}.".startswith(f"{p}.")
            for p in ENTRY_PACKAGES
        )
        if theirs >= mine and not same_package:
            found.append(
                f"{module} -> {target}: layer {LAYERS[mine][0]!r} may not import "
                f"layer {LAYERS[theirs][0]!r}"
            )
    return found


def all_imports() -> dict[str, set[str]]:
    graph = {}
    for package in PROJECT:
        for module, path in project_modules(package).items():
            graph[module] = imports(module, path.read_text(), path.name == "__init__.py")
    return graph


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return all_imports()


def test_every_jobs_module_has_a_layer(graph):
    unplaced = sorted(m for m in graph if m.split(".")[0] == "jobs" and layer_of(m) is None)
    assert not unplaced, f"place these in LAYERS (and docs/architecture.md): {unplaced}"


def test_imports_follow_the_rules(graph):
    found = [line for module, targets in graph.items() for line in violations(module, targets)]
    assert not found, "imports against docs/architecture.md:\n" + "\n".join(found)


def test_known_exceptions_still_exist(graph):
    """An exception that was fixed comes off the list, so it cannot come back unnoticed."""
    gone = [pair for pair in KNOWN_EXCEPTIONS if pair[1] not in graph.get(pair[0], set())]
    assert not gone, f"no longer imported, remove from KNOWN_EXCEPTIONS: {gone}"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph`: each strongly connected set of two modules or more
    (Tarjan's algorithm, iterative: the graph has hundreds of modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in graph:
                    continue
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    if len(members) > 1:
                        found.append(sorted(members))
    return found


def test_no_import_cycle(graph):
    """The layers forbid a cycle between layers; this also finds one inside an entry
    package (which may import its own modules) or among the packages around jobs."""
    assert cycles(graph) == []


def test_cycles_are_found():
    found = cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}})
    assert found == [["a", "b", "c"]]


def test_callers_take_the_services_from_the_package(graph):
    """jobs.services is one face: a module of jobs outside it imports its public names
    from `jobs.services`, never from a room inside (tests and benchmarks may read a
    statement's text where it lives)."""
    inside = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module.split(".")[0] == "jobs" and not module.startswith("jobs.services")
        for target in targets
        if target.startswith("jobs.services.")
    ]
    assert inside == []


def test_callers_take_the_models_from_the_package(graph):
    """jobs.models is one face too (D401): every module of the project outside it, tests
    included, imports a model from `jobs.models`, never from a room inside, so a model
    may move between rooms without a caller changing."""
    inside = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        if not module.startswith("jobs.models")
        for target in targets
        if target.startswith("jobs.models.")
    ]
    assert graph["jobs.models"] >= {"jobs.models.jobs", "jobs.models.events"}
    assert inside == []


# Modules of jobs longer than LONGEST_MODULE lines, each with why; the test fails once
# one is shorter, so the list only shrinks.
LONGEST_MODULE = 600
LONG_MODULES: dict[str, int] = {}  # none now (D401, D402)


def test_no_module_is_longer_than_a_reader_holds():
    lines = {
        module: len(path.read_text().splitlines())
        for module, path in project_modules("jobs").items()
    }
    long = {m: n for m, n in lines.items() if n > LONGEST_MODULE}
    assert {m: n for m, n in long.items() if m not in LONG_MODULES} == {}
    assert sorted(set(LONG_MODULES) - set(long)) == [], "shorter now: remove from LONG_MODULES"


def test_the_lifecycle_imports_nothing_of_the_project(graph):
    assert not {t for t in graph["jobs.lifecycle"] if t.split(".")[0] in PROJECT}


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        # an import running back up the layers, also inside a function
        ("jobs.models", "from jobs.services import claim\n",
         "jobs.models -> jobs.services: layer 'models' may not import layer 'services"),
        ("jobs.services", "def f():\n    from jobs import worker\n",
         "jobs.services -> jobs.worker: layer 'services and selectors' may not import"),
        # a peer of the same layer, relative
        ("jobs.worker", "from .reaper import Reaper\n",
         "jobs.worker -> jobs.reaper: layer 'processes' may not import layer 'processes'"),
        # one entry point reaching into another
        ("jobs.api.views", "from jobs.admin import JobAdmin\n",
         "jobs.api.views -> jobs.admin: layer 'entry points' may not import"),
        ("jobs.management.commands.slo", "from jobs.management.commands import prunejobs\n",
         "jobs.management.commands.slo -> jobs.management.commands.prunejobs: layer"),
        ("jobs.lifecycle", "import jobs.models\n",
         "jobs.lifecycle -> jobs.models: layer 'leaves' may not import layer 'models'"),
        ("jobs.worker", "from tests.harness import wait_until\n",
         "jobs.worker -> tests.harness: jobs never imports tests"),
        ("jobs.worker", "from jobservice import settings\n",
         "jobs.worker -> jobservice.settings: jobs never imports jobservice"),
        ("harness.procs", "from jobs.models import Job\n",
         "harness.procs -> jobs.models: harness never imports jobs"),
        ("bench.scenarios", "from tests import harness\n",
         "bench.scenarios -> tests.harness: bench never imports tests"),
        ("jobs.services", "import redis\n",
         "jobs.services -> redis: only ['jobs.transport'] may import redis"),
    ],
)  # fmt: skip
def test_the_rules_catch_a_bad_import(module, source, expected):
    """The checks above can fail: each kind of bad import is reported with its module."""
    found = violations(module, imports(module, source))
    assert len(found) == 1 and found[0].startswith(expected), found


def test_allowed_imports_pass():
    """Downward imports, an entry package's own modules and the embedded database pass."""
    for module, source in [
        ("jobs.worker", "from jobs import lifecycle, services\nfrom jobs.presence import x\n"),
        ("jobs.api.views", "from .serializers import JobSerializer\nfrom jobs.backends import b\n"),
        ("jobs.admin.actions", "from jobs.admin.dashboard import d\nfrom jobs import services\n"),
        ("jobs.admin", "from jobs.admin.options import JobAdmin\nfrom jobs import selectors\n"),
        ("jobs.management.commands.runstack", "from jobservice.embedded import ensure\n"),
        ("jobs.transport", "import redis\nfrom jobs import metrics\n"),
        ("bench.scenarios", "import harness\nfrom jobs import services\n"),
    ]:
        assert not violations(module, imports(module, source)), (module, source)


def test_each_exception_class_is_defined_once():
    """One exception module (jobs.exceptions): a refusal has one class, so nothing
    translates one `IdempotencyConflict` into another on the way to the API."""
    defined: dict[str, list[str]] = {}
    for path in sorted((ROOT / "jobs").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            is_error = isinstance(node, ast.ClassDef) and node.name.endswith(
                ("Error", "Exception", "Conflict", "Conflicts")
            )
            if is_error:
                defined.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert defined, "no exception classes found: the scan is broken"
    assert {name: where for name, where in defined.items() if len(where) > 1} == {}
