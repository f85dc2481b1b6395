"""manage.py sequence show|resume|skip KEY [--client NAME] (docs/queue-controls.md)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.flow import sequences
from jobs.models import Client


class Command(BaseCommand):
    help = (
        "Show a sequence (the job whose turn it is, the failed job that halted it, what "
        "waits), resume it (the failed job runs again, then the rest in order) or skip "
        "its failed job (it stays failed; the next job runs)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        for action, what in (
            ("show", "Show sequence KEY."),
            ("resume", "Run the failed job of halted sequence KEY again, then the rest."),
            ("skip", "Leave the failed job of halted sequence KEY failed; run the next."),
        ):
            cmd = sub.add_parser(action, help=what)
            cmd.add_argument("key", metavar="KEY")
            cmd.add_argument(
                "--client", default=None, help="The API client owning the key (default: none)."
            )

    def handle(self, *args, **opts) -> None:
        client_id = None
        if opts["client"] is not None:
            client = Client.objects.filter(name=opts["client"]).first()
            if client is None:
                raise CommandError(f"unknown client {opts['client']!r}")
            client_id = client.pk
        key, action = opts["key"], opts["action"]
        if action != "show":
            try:
                getattr(sequences, action)(client_id, key, "staff:manage.py")
            except sequences.SequenceRefused as refused:
                raise CommandError(str(refused)) from None
        found = sequences.detail(client_id, key)
        if found is None:
            raise CommandError(f"no sequence {key!r}")
        page = found.as_dict()
        self.stdout.write(f"sequence {key}: {page['state']}, {page['waiting']} waiting")
        for label in ("active_job", "halted_job"):
            job = page[label]
            if job is not None:
                error = f" ({job['error']})" if job["error"] else ""
                self.stdout.write(f"  {label.replace('_', ' ')}: {job['id']} {job['task']} "
                                  f"[{job['status']}]{error}")  # fmt: skip
        for job in page["next_jobs"][:10]:
            self.stdout.write(f"  next: {job['id']} {job['task']}")
