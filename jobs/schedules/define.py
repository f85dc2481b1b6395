"""Creating and changing schedules: the rules a schedule's job is held to are those of a
submission (jobs.submission), checked when the schedule is written, so a schedule
never fires a job the API would refuse. A refusal raises a SubmissionError naming the
field and writes nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, transaction

from jobs import admission, tasks, validation
from jobs.exceptions import InvalidSubmission, RequestInvalid, SubmissionError
from jobs.models import Client, Schedule
from jobs.observability import hooks
from jobs.schedules import periodic, timing
from jobs.selectors import db_now

log = logging.getLogger(__name__)

NAME_MAX = 200
FIELDS = (
    "name", "cron", "interval_seconds", "timezone", "task", "payload", "queue", "priority",
    "max_retries", "enabled", "catch_up", "overlap", "concurrency_key", "timeout",
)  # fmt: skip
TIMING_FIELDS = frozenset({"cron", "interval_seconds", "timezone"})


def _refuse(exc: timing.InvalidTiming) -> InvalidSubmission:
    return InvalidSubmission(str(exc), field=exc.field, code=f"invalid_{exc.field}")


def _choice(name: str, value: Any, choices: list[str]) -> str:
    if value not in choices:
        raise InvalidSubmission(
            f"{name} must be one of: {', '.join(choices)}", field=name, code=f"invalid_{name}"
        )
    return value


def check(values: dict[str, Any], *, for_client: bool = False) -> dict[str, Any]:
    """A complete definition → the values to store; raises RequestInvalid listing every
    refused field (or the one SubmissionError when only one is). A client's schedule
    runs public tasks only (`for_client`)."""
    problems: list[SubmissionError] = []
    out = dict(values)

    def attempt(fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except timing.InvalidTiming as exc:
            problems.append(_refuse(exc))
        except SubmissionError as exc:
            problems.append(exc)
        return None

    name = values.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > NAME_MAX:
        problems.append(
            InvalidSubmission(
                f"name must be 1-{NAME_MAX} characters", field="name", code="invalid_name"
            )
        )
    elif why := validation.why_unstorable(name):
        problems.append(
            InvalidSubmission(f"name may not contain {why}", field="name", code="invalid_name")
        )
    cron, interval = values.get("cron"), values.get("interval_seconds")
    if (cron is None) == (interval is None):
        problems.append(
            InvalidSubmission(
                "give exactly one of cron and interval_seconds",
                field="cron" if cron is None else "interval_seconds",
                code="invalid_timing",
            )
        )
    elif cron is not None:
        out["cron"] = attempt(timing.check_cron, cron)
    else:
        out["interval_seconds"] = attempt(timing.check_interval, interval)
    attempt(timing.check_zone, values.get("timezone", "UTC"))
    attempt(_choice, "catch_up", values.get("catch_up"), Schedule.CatchUp.values)
    attempt(_choice, "overlap", values.get("overlap"), Schedule.Overlap.values)
    if not isinstance(values.get("enabled"), bool):
        problems.append(
            InvalidSubmission("enabled must be true or false", field="enabled", code="invalid")
        )
    if "payload" in values and values["payload"] is None:
        problems.append(
            InvalidSubmission("payload may not be null", field="payload", code="invalid_payload")
        )
    else:
        # The job it makes, held to a submission's rules (task, payload, queue, ...).
        attempt(
            validation.validate,
            values.get("task"),
            values.get("payload"),
            values.get("queue"),
            values.get("priority"),
            None,
            values.get("max_retries"),
            None,
            None,
            values.get("concurrency_key"),
            values.get("timeout"),
            for_client=for_client,
        )
    if len(problems) == 1:
        raise problems[0]
    if problems:
        errors: dict[str, list[dict[str, str]]] = {}
        for exc in problems:
            errors.setdefault(exc.field or "non_field_errors", []).append(
                {"message": exc.message, "code": exc.code}
            )
        raise RequestInvalid(errors)
    return out


DEFAULTS = {
    "timezone": "UTC",
    "payload": {},
    "queue": "default",
    "priority": 0,
    "max_retries": None,
    "timeout": None,
    "enabled": True,
    "catch_up": Schedule.CatchUp.SKIP.value,
    "overlap": Schedule.Overlap.ALLOW.value,
    "cron": None,
    "interval_seconds": None,
    "concurrency_key": None,
}


def first_slot(values: dict[str, Any]) -> Any:
    """The first slot after the database's now: the next cron time, or now + interval."""
    rule = timing.Timing(values.get("cron"), values.get("interval_seconds"), values["timezone"])
    return rule.next_after(db_now())


def _save(schedule: Schedule) -> Schedule:
    try:
        with transaction.atomic():
            schedule.save()
    except IntegrityError as exc:
        if "schedule_name_per_client" in str(exc):
            raise InvalidSubmission(
                f"a schedule named {schedule.name!r} exists", field="name", code="name_taken"
            ) from None
        raise
    return schedule


def create(values: dict[str, Any], *, client: Client | None, origin: str) -> Schedule:
    """A new schedule from `values` (FIELDS; missing ones take DEFAULTS)."""
    checked = check({**DEFAULTS, **values}, for_client=client is not None)
    schedule = Schedule(client=client, origin=origin, **{k: checked[k] for k in FIELDS})
    schedule.next_fire_at = first_slot(checked) if checked["enabled"] else None
    schedule.trace_context = hooks.link_context()  # its jobs link to the creating trace
    with transaction.atomic():
        if client is not None:
            admission.check_quota(admission.SCHEDULES, client.pk)
        return _save(schedule)


def update(schedule: Schedule, changes: dict[str, Any]) -> Schedule:
    """Apply `changes` (a subset of FIELDS). A new timing, or enabling a paused schedule,
    starts from the next slot after now: nothing is caught up for the paused time."""
    current = {k: getattr(schedule, k) for k in FIELDS}
    merged = {**current, **changes}
    if "cron" in changes and changes["cron"] is not None and "interval_seconds" not in changes:
        merged["interval_seconds"] = None
    if (
        "interval_seconds" in changes
        and changes["interval_seconds"] is not None
        and ("cron" not in changes)
    ):
        merged["cron"] = None
    checked = check(merged, for_client=schedule.client_id is not None)
    restart = any(checked[k] != current[k] for k in TIMING_FIELDS) or (
        checked["enabled"] and not current["enabled"]
    )
    for k in FIELDS:
        setattr(schedule, k, checked[k])
    if not checked["enabled"]:
        schedule.next_fire_at = None  # a paused schedule has no next run to show
    elif restart or schedule.next_fire_at is None:
        schedule.next_fire_at = first_slot(checked)
    schedule.updated_at = db_now()
    return _save(schedule)


def sync_periodic() -> int:
    """Write every `@periodic` declaration to the table (client None, origin code):
    created enabled, updated in every field but `enabled`, which belongs to staff
    once the schedule exists. A declaration removed from the code leaves its schedule
    as it is (delete it in the admin). Returns how many were created or changed."""
    by_handler = _task_names()
    changed = 0
    for declared in periodic.DECLARED:
        values = _resolved(declared, by_handler)
        try:
            changed += _sync_one(values["name"], values)
        except SubmissionError as exc:  # which declaration, and every broken rule
            raise ImproperlyConfigured(_refused(values, exc)) from exc
    return changed


def periodic_problems() -> list[str]:
    """What the sync at migrate would refuse, one line per declaration: `check` says it
    before `migrate` fails on it (jobs.E106)."""
    by_handler = _task_names()
    problems = []
    for declared in periodic.DECLARED:
        try:
            values = _resolved(declared, by_handler)
            check({**DEFAULTS, **values})
        except ImproperlyConfigured as exc:
            problems.append(str(exc))
        except SubmissionError as exc:
            problems.append(_refused(values, exc))
    return problems


def _task_names() -> dict[Any, str]:
    return {spec.fn: spec.name for spec in tasks.load().values()}


def _resolved(declared: dict[str, Any], by_handler: dict[Any, str]) -> dict[str, Any]:
    """A declaration's schedule fields, its task named (a handler's registered name)."""
    values = {k: v for k, v in declared.items() if k != "handler"}
    if values["task"] is None:
        values["task"] = by_handler.get(declared["handler"])
    if values["task"] is None:
        raise ImproperlyConfigured(
            f"@periodic on {declared['handler']!r}: not a registered task; put "
            "@periodic above @task, or name the task with task="
        )
    values["name"] = values["name"] or values["task"]
    return values


def _refused(values: dict[str, Any], exc: SubmissionError) -> str:
    return f"@periodic schedule {values['name']!r}: {exc}"


def _sync_one(key: str, values: dict[str, Any]) -> int:
    existing = Schedule.objects.filter(client=None, name=key).first()
    if existing is None:
        try:
            create(values, client=None, origin=Schedule.Origin.CODE)
            return 1
        except InvalidSubmission as exc:
            if exc.code != "name_taken":  # another process synced it just now
                raise
        existing = Schedule.objects.get(client=None, name=key)
    if existing.origin != Schedule.Origin.CODE:
        log.warning("schedule %r exists and is not declared in code; not synced", key)
        return 0
    if any(getattr(existing, k) != v for k, v in values.items()):
        update(existing, values)
        return 1
    return 0
