"""manage.py jobs list|show|retry|cancel|revoke|repair|purge (docs/operations.md).

Reads come from jobs.selectors; every change is the admin action's own spec run by
`jobs.staff.run`, as a staff user (`--as`, by default the OS user's name), so it is
refused, applied and audited exactly as the admin's would be.
"""

from __future__ import annotations

import argparse
import getpass
import re
import sys
from datetime import datetime, timedelta
from typing import Any

import orjson
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from jobs import selectors, staff
from jobs.lifecycle import Status
from jobs.queues import QUEUE_NAME_RE

# The admin actions each verb runs, in order: `cancel` is the admin's two cancels, one
# for jobs not started and one asking a running handler to stop.
VERBS: dict[str, tuple[staff.StaffAction, ...]] = {
    "retry": (staff.RETRY,),
    "cancel": (staff.CANCEL, staff.CANCEL_RUNNING),
    "revoke": (staff.REVOKE,),
    "repair": (staff.REPAIR,),
}
LIST_LIMIT_MAX = 1000
_AGO = re.compile(r"(\d+)([smhd])")
_UNIT = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
# A listing's fields, in the order the table prints them.
LIST_FIELDS = ("id", "status", "queue", "task", "client", "retries", "created_at", "error")


def since_arg(text: str) -> datetime:
    """An ISO 8601 time, or a duration ago: 90s, 15m, 2h, 7d."""
    ago = _AGO.fullmatch(text)
    if ago:
        return timezone.now() - timedelta(**{_UNIT[ago[2]]: int(ago[1])})
    try:
        when = parse_datetime(text)
    except ValueError:
        when = None
    if when is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither an ISO 8601 time nor a duration such as 15m, 2h or 7d"
        )
    return when if timezone.is_aware(when) else timezone.make_aware(when)


def job_id_arg(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 2**63:
        raise argparse.ArgumentTypeError(f"{text!r} is not a job id")
    return int(text)


def queue_arg(text: str) -> str:
    if not QUEUE_NAME_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a queue name")
    return text


def limit_arg(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= LIST_LIMIT_MAX:
        raise argparse.ArgumentTypeError(f"the limit is 1 to {LIST_LIMIT_MAX}")
    return int(text)


def _json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2).decode()


def _when(value: datetime | None) -> str:
    return value.isoformat(timespec="seconds") if value else "-"


def listed(job: Any) -> dict[str, Any]:
    return {
        "id": job.pk,
        "status": job.status,
        "queue": job.queue,
        "task": job.task,
        "client": job.client.name if job.client else None,
        "retries": f"{job.retry_count}/{job.max_retries}",
        "created_at": job.created_at,
        "error": job.error,
    }


def shown(job: Any, history: list[Any]) -> dict[str, Any]:
    return {
        **listed(job),
        "priority": job.priority,
        "payload": job.payload,
        "result": job.result,
        "error_class": job.error_class,
        "error_traceback": job.error_traceback,
        "lease_version": job.lease_version,
        "owned_by": job.owned_by,
        "run_at": job.run_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "cancel_requested_at": job.cancel_requested_at,
        "updated_by": job.updated_by,
        "history": [
            {
                "at": e.at,
                "kind": e.kind,
                "from_status": e.from_status,
                "to_status": e.to_status,
                "actor": e.actor,
                "lease_version": e.lease_version,
                "retry_count": e.retry_count,
                "error": e.error,
                "error_class": e.error_class,
                "error_traceback": e.error_traceback,
            }
            for e in history
        ],
    }


class Command(BaseCommand):
    help = (
        "List and show jobs; retry, cancel, revoke or repair them, or purge a queue's "
        "jobs not started, as the admin's actions do (same refusals, same audit)."
    )
    stealth_options = ("stdin",)  # tests answer the purge's confirmation

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        ls = sub.add_parser("list", help="The newest jobs matching the filters.")
        ls.add_argument("--status", action="append", choices=Status.values, default=[])
        ls.add_argument("--queue", type=queue_arg)
        ls.add_argument("--task")
        ls.add_argument("--client", help="A client's name or id.")
        ls.add_argument(
            "--since", type=since_arg, help="Created since: ISO 8601, or 90s, 15m, 2h, 7d ago."
        )
        ls.add_argument("--limit", type=limit_arg, default=50, help="At most N (default 50).")
        ls.add_argument("--json", action="store_true", help="A JSON array.")
        show = sub.add_parser("show", help="A job with its error, traceback and history.")
        show.add_argument("id", type=job_id_arg)
        show.add_argument("--json", action="store_true")
        actor = argparse.ArgumentParser(add_help=False)
        actor.add_argument(
            "--as",
            dest="username",
            default=None,
            help="The staff user acting, audited as in the admin (default: the OS user).",
        )
        for verb, specs in VERBS.items():
            cmd = sub.add_parser(
                verb, parents=[actor], help=" / ".join(str(s.label) for s in specs) + "."
            )
            cmd.add_argument("ids", nargs="+", type=job_id_arg, metavar="ID")
        purge = sub.add_parser(
            "purge", parents=[actor], help="Cancel the jobs of a queue that have not started."
        )
        purge.add_argument("queue", type=queue_arg, metavar="QUEUE")
        purge.add_argument("--yes", action="store_true", help="Do not ask for confirmation.")
        purge.add_argument("--dry-run", action="store_true", help="Count them; change nothing.")

    def handle(self, *args: Any, **opts: Any) -> None:
        self.stdin = opts.get("stdin", sys.stdin)
        verb = opts["verb"]
        if verb == "list":
            self.list(opts)
        elif verb == "show":
            self.show(opts["id"], opts["json"])
        elif verb == "purge":
            self.purge(opts)
        else:
            self.act(VERBS[verb], opts["ids"], opts["username"])

    def list(self, opts: dict[str, Any]) -> None:
        jobs = selectors.job_listing(
            statuses=opts["status"],
            queue=opts["queue"],
            task=opts["task"],
            client=opts["client"],
            since=opts["since"],
            limit=opts["limit"],
        )
        rows = [listed(job) for job in jobs]
        if opts["json"]:
            self.stdout.write(_json(rows))
            return
        for row in rows:
            row["created_at"] = _when(row["created_at"])
            row["error"] = (row["error"] or "-").splitlines()[0][:80]
            self.stdout.write("\t".join(str(row[f] or "-") for f in LIST_FIELDS))

    def show(self, job_id: int, as_json: bool) -> None:
        found = selectors.job_with_history(job_id)
        if found is None:
            raise CommandError(f"no job {job_id}")
        detail = shown(*found)
        if as_json:
            self.stdout.write(_json(detail))
            return
        history = detail.pop("history")
        traceback = detail.pop("error_traceback")
        for name, value in detail.items():
            shown_value = value if not isinstance(value, datetime) else _when(value)
            self.stdout.write(f"{name}: {'-' if shown_value is None else shown_value}")
        if traceback:
            self.stdout.write("traceback:\n" + traceback.rstrip())
        self.stdout.write("history:")
        for e in history:
            line = (
                f"  {_when(e['at'])} {e['kind']} {e['from_status'] or 'new'} → "
                f"{e['to_status']} by {e['actor']} (lease {e['lease_version']}, "
                f"retries {e['retry_count']})"
            )
            self.stdout.write(line + (f": {e['error']}" if e["error"] else ""))

    def staff_user(self, username: str | None, specs: tuple[staff.StaffAction, ...]) -> Any:
        """The acting user, refused as the admin would refuse them."""
        username = username or getpass.getuser()
        user_model = get_user_model()
        try:
            user = user_model._default_manager.get_by_natural_key(username)
        except user_model.DoesNotExist:
            raise CommandError(
                f"no user {username!r}: pass --as USERNAME, a staff user allowed this action"
            ) from None
        for spec in specs:
            try:
                staff.check_allowed(user, spec)
            except staff.StaffRefused as exc:
                raise CommandError(f"{exc}; nothing changed") from None
        return user

    def act(self, specs: tuple[staff.StaffAction, ...], ids: list[int], username: str | None):
        ids = sorted(set(ids))
        missing = selectors.missing_job_ids(ids)
        if missing:
            raise CommandError(f"no job {', '.join(map(str, missing))}; nothing changed")
        selected = selectors.jobs_by_id(ids)
        # Only the permissions of the actions that have a job to act on are needed, as
        # in the admin, where a user offered "cancel" alone may cancel a queued job.
        needed = tuple(s for s in specs if selected.eligible_for(s.move).exists()) or specs[:1]
        user = self.staff_user(username, needed)
        applied = {spec: staff.run(spec, selected, user) for spec in needed}
        skipped = len(ids) - sum(applied.values())
        if len(specs) == 1:
            text = staff.outcome(specs[0], applied.get(specs[0], 0), skipped)
        else:
            text = ", ".join(f"{applied.get(s, 0)} {s.verb}" for s in specs)
            if skipped:
                text += f", {skipped} skipped: finished"
        self.stdout.write(self.style.WARNING(text) if skipped else self.style.SUCCESS(text))

    def purge(self, opts: dict[str, Any]) -> None:
        queue = opts["queue"]
        waiting = selectors.not_started_in_queue(queue)
        count, exact = selectors.capped_count(waiting, 100_000)
        about = f"{count if exact else f'about {count}'} job(s) of queue {queue} not started"
        if not count:
            self.stdout.write(f"no job of queue {queue} waits to start; nothing to purge")
            return
        if opts["dry_run"]:
            first = waiting.order_by("pk").values_list("pk", flat=True)[:10]
            sample = ", ".join(map(str, first))
            self.stdout.write(f"would cancel {about} (first ids: {sample}); nothing changed")
            return
        user = self.staff_user(opts["username"], (staff.CANCEL,))
        if not opts["yes"]:
            self.stdout.write(f"Cancel {about}, as {staff.actor(user)}? Type 'yes' to go on: ")
            if self.stdin.readline().strip().lower() != "yes":
                raise CommandError("purge not confirmed; nothing changed")
        applied = staff.run(staff.CANCEL, waiting, user)
        text = f"{staff.outcome(staff.CANCEL, applied, 0)} in queue {queue}"
        self.stdout.write(self.style.SUCCESS(text))
