"""One vocabulary for the lifecycle: every move a service or a staff action makes is
named in `jobs.lifecycle`, checked against TRANSITIONS, and no status is spelled out
as a raw literal anywhere else in the product code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from jobs import lifecycle, services
from jobs import staff as jobs_admin
from jobs.lifecycle import MOVES, STATUSES, Status, is_legal
from jobs.models import Job
from jobs.services import fencing
from jobs.services.claims import plain
from tests.factories import JobFactory

JOBS = Path(__file__).resolve().parent.parent / "jobs"


# --- moves against TRANSITIONS ---------------------------------------------------


@pytest.mark.parametrize("name", sorted(MOVES))
def test_every_move_is_legal(name):
    """Each source state may reach some target (staying counts), and each target is
    reached from some source: a move never asks for a transition TRANSITIONS lacks."""
    move = MOVES[name]
    assert move.sources and move.targets
    for source in move.sources:
        assert any(is_legal(source, t) for t in move.targets), (name, source)
    for target in move.targets:
        assert any(is_legal(s, target) for s in move.sources), (name, target)


@pytest.mark.parametrize("spec", jobs_admin.STAFF_ACTIONS, ids=lambda s: s.name)
def test_staff_action_eligibility_is_its_move(spec):
    assert spec.move in MOVES.values()
    assert set(spec.eligible) == spec.move.sources
    assert all(any(is_legal(s, t) for t in spec.move.targets) for s in spec.eligible)


@pytest.mark.parametrize(
    "move,sql",
    [
        (lifecycle.CLAIM, plain._CLAIM_NEXT_SQL),
        (lifecycle.CLAIM, plain._CLAIM_IDS_SQL),
        (lifecycle.COMPLETE, fencing._COMPLETE_SQL),
        (lifecycle.FAIL_ATTEMPT, fencing._FAIL_SQL),
        (lifecycle.RELEASE, fencing._RELEASE_SQL),
    ],
    ids=["claim_next", "claim_ids", "complete", "fail", "release"],
)
def test_worker_statements_select_their_moves_sources(move, sql):
    """The claim and the fenced writes (whose fence names the held state) read the
    rows their move takes, and only those."""
    assert move.where() in sql or move.where("j.status") in sql


def _one_job_per_state() -> dict[Status, Job]:
    return {s: JobFactory.create(status=s.value) for s in Status}


def _snapshot(jobs: dict[Status, Job]) -> dict[Status, tuple]:
    rows = Job.objects.in_bulk([j.pk for j in jobs.values()])
    return {
        s: (rows[j.pk].status, rows[j.pk].updated_at, rows[j.pk].cancel_requested_at)
        for s, j in jobs.items()
    }


STAFF = "staff:alice"
SERVICES = [
    ("staff_retry", lifecycle.STAFF_RETRY, lambda ids: services.staff_retry(ids, STAFF)),
    ("staff_repair", lifecycle.REPAIR, lambda ids: services.staff_repair(ids, STAFF)),
    ("revoke", lifecycle.REVOKE, lambda ids: services.revoke(ids, STAFF)),
    ("cancel", lifecycle.CANCEL, lambda ids: services.cancel(ids, STAFF)),
    ("request_cancel", lifecycle.REQUEST_CANCEL, lambda ids: services.request_cancel(ids, STAFF)),
    ("mark_enqueue_failed", lifecycle.PARK, services.mark_enqueue_failed),
]


@pytest.mark.django_db
@pytest.mark.parametrize("name,move,call", SERVICES, ids=[s[0] for s in SERVICES])
def test_service_touches_exactly_its_moves_sources(name, move, call):
    """Given one job in every state, the service changes the rows in the move's
    source states, leaves them in one of its targets, and touches nothing else."""
    jobs = _one_job_per_state()
    before = _snapshot(jobs)
    call([j.pk for j in jobs.values()])
    after = _snapshot(jobs)
    touched = {s for s in Status if after[s] != before[s]}
    assert touched == move.sources, name
    for s in touched:
        assert after[s][0] in move.targets and is_legal(s, after[s][0]), (name, s, after[s])


@pytest.mark.django_db
@pytest.mark.parametrize("spec", jobs_admin.STAFF_ACTIONS, ids=lambda s: s.name)
def test_staff_action_service_takes_every_eligible_job(spec):
    """What the admin offers as eligible, its service really moves."""
    jobs = _one_job_per_state()
    eligible = [jobs[s].pk for s in spec.eligible]
    assert sorted(spec.service(eligible, STAFF)) == sorted(eligible)


# --- no raw status literals ------------------------------------------------------

SQL_STATUS = re.compile("'(" + "|".join(STATUSES) + ")'")
# Code where a status word names something else: the dashboard's query names and
# QueueRow fields, and the progress report's fields.
OTHER_VOCABULARY = {"dashboard_queries", "dashboard", "progress"}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _other_vocabulary(node: ast.Constant, parent: ast.AST | None) -> bool:
    """A status word that is not a status: a dict key or subscript (progress
    fields), a `.get()` argument, or a worker outcome kind (`o.kind == "done"`,
    `Outcome(lease, "done")`)."""
    if isinstance(parent, ast.Dict) and any(k is node for k in parent.keys):
        return True
    if isinstance(parent, ast.Subscript) and parent.slice is node:
        return True
    if isinstance(parent, ast.Call):
        func = parent.func
        if isinstance(func, ast.Attribute) and func.attr == "get":
            return True
        if isinstance(func, ast.Name) and func.id == "Outcome":
            return True
    if isinstance(parent, ast.Tuple | ast.Compare):
        compare = parent if isinstance(parent, ast.Compare) else getattr(parent, "_parent", None)
        if isinstance(compare, ast.Compare):
            sides = [compare.left, *compare.comparators]
            return any(isinstance(s, ast.Attribute) and s.attr == "kind" for s in sides)
    return False


def raw_status_literals(path: Path, root: Path = JOBS.parent) -> list[str]:
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    found = []

    def visit(node: ast.AST, parent: ast.AST | None, function: str | None) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        if function in OTHER_VOCABULARY:
            return
        node._parent = parent  # type: ignore[attr-defined]
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docs
            and (
                SQL_STATUS.search(node.value)
                or (node.value in STATUSES and not _other_vocabulary(node, parent))
            )
        ):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
        for child in ast.iter_child_nodes(node):
            visit(child, node, function)

    visit(tree, None, None)
    return found


def product_files() -> list[Path]:
    return sorted(
        p for p in JOBS.rglob("*.py") if "migrations" not in p.parts and p != JOBS / "lifecycle.py"
    )


def test_no_raw_status_literals_outside_lifecycle():
    """Statuses and SQL fragments that name one are built from `jobs.lifecycle`."""
    found = [hit for path in product_files() for hit in raw_status_literals(path)]
    assert not found, "\n".join(found)


def test_the_literal_check_sees_what_it_must(tmp_path):
    """The check itself: each way a raw status can come back is caught."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def f(job, cur):\n"
        "    if job.status == 'queued':\n"
        "        cur.execute(\"UPDATE jobs_job SET status = 'failed'\")\n"
        "    return Job.objects.filter(status__in=('done', 'processing'))\n"
        "def g(o):\n"
        "    return o.kind == 'done', {'done': 1}['done']\n"
    )
    hits = raw_status_literals(sample, root=tmp_path)
    assert [h.split(": ", 1)[1] for h in hits] == [
        "'queued'",
        "\"UPDATE jobs_job SET status = 'failed'\"",
        "'done'",
        "'processing'",
    ]
