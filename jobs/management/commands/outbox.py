"""manage.py outbox list|start (docs/events.md): where each outbox subscriber stands, and
where a sink added later starts (D193)."""

from __future__ import annotations

import argparse

from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.events import cursors
from jobs.events.lag import lag


def position(value: str) -> str | int:
    """`beginning`, `now` or an event id (after which the subscriber starts)."""
    if value in (cursors.BEGINNING, cursors.NOW):
        return value
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: beginning, now or an event id")
    return number


class Command(BaseCommand):
    help = (
        "List the outbox's subscribers (position, how far behind), or choose where one "
        "without a cursor starts: from the beginning of the history, from now (what was "
        "written before is never sent to it) or after an event id."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        sub.add_parser("list", help="Each subscriber's cursor and lag, or 'not started'.")
        start = sub.add_parser("start", help="Place a subscriber's first position.")
        start.add_argument("names", nargs="+", choices=sorted(cursors.CURSORS),
                           metavar="SUBSCRIBER",
                           help=f"one of {', '.join(sorted(cursors.CURSORS))}")  # fmt: skip
        start.add_argument("--from", dest="position", type=position, required=True,
                           help="beginning, now or an event id: the subscriber gets the "
                           "events after it")  # fmt: skip
        start.add_argument("--move", action="store_true",
                           help="also move a subscriber that is started: forward skips "
                           "events, back sends them again")  # fmt: skip

    def handle(self, *args, **opts) -> None:
        if opts["action"] == "list":
            self._list()
        else:
            self._start(opts["names"], opts["position"], opts["move"])

    def _list(self) -> None:
        rows = {r.subscriber: r for r in lag()}
        for name in sorted({*cursors.CURSORS, *rows}):
            row = rows.get(name)
            if row is None:
                self.stdout.write(f"{name}: not started (manage.py outbox start {name} "
                                  "--from beginning|now|ID)")  # fmt: skip
            else:
                moved = row.updated_at.isoformat(timespec="seconds")
                self.stdout.write(f"{name}: after event {row.last_id}, {row.events} behind, "
                                  f"oldest {row.seconds:.1f}s, moved {moved}")  # fmt: skip

    def _start(self, names: list[str], where: str | int, move: bool) -> None:
        sources = {cursors.CURSORS[n] for n in names}
        if isinstance(where, int) and len(sources) > 1:
            raise CommandError(
                "an event id belongs to one table: name the history's subscribers and the "
                "domain events' (kafka.domain) apart"
            )
        place = cursors.move_cursor_skipping_or_repeating if move else cursors.start_cursor
        for name in dict.fromkeys(names):
            try:
                placed = place(name, where)
            except cursors.CursorExists as exc:
                raise CommandError(f"{exc}: --move to move it (skips or repeats events)") from exc
            except ValueError as exc:
                raise CommandError(str(exc)) from exc
            was = "not started" if placed.was is None else f"was after event {placed.was}"
            self.stdout.write(f"{name}: starts after event {placed.last_id} ({was})")
