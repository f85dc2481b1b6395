"""When a schedule's slots fall: cron expressions (croniter) in an IANA zone, or intervals.

Cron slots are wall-clock times in the schedule's zone, each mapped to one instant
the way PEP 495 maps local times with fold=0 (D59): in the hour a zone repeats (autumn)
a time fires once, at its first occurrence; a time the zone skips (spring) fires at
the instant it would have had before the change (02:30 in a 02:00→03:00 gap fires at
03:30 new time), and a slot that maps onto an instant already taken is the same slot.
Intervals are plain durations from the schedule's first slot, blind to the zone.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from croniter import croniter

# Five fields, or six with seconds first ("*/10 * * * * *": every ten seconds).
SECONDS_FIRST = True
# Bounds a search for the next or previous slot (an expression like "0 0 30 2 *" never fires).
MAX_STEPS = 1000


class InvalidTiming(ValueError):
    """A cron expression, zone or interval a schedule cannot have; `field` names it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check_cron(expr: object) -> str:
    if not isinstance(expr, str) or len(expr) > 200:
        raise InvalidTiming("cron must be a string of at most 200 characters", "cron")
    fields = expr.split()
    if len(fields) not in (5, 6):
        raise InvalidTiming(
            "cron must have 5 fields (minute hour day month weekday), or 6 with seconds first",
            "cron",
        )
    if not croniter.is_valid(" ".join(fields), second_at_beginning=SECONDS_FIRST, strict=True):
        raise InvalidTiming(f"not a valid cron expression: {expr!r}", "cron")
    try:
        Timing(cron=" ".join(fields), interval=None, zone="UTC").next_after(
            datetime(2000, 1, 1, tzinfo=UTC)
        )
    except InvalidTiming:
        raise InvalidTiming(f"cron expression {expr!r} never fires", "cron") from None
    return " ".join(fields)


# Files of the host's zoneinfo that are no zone of their own: "localtime" is whatever the
# machine is set to, so a schedule in it would fire at other hours on another host.
HOST_ZONES = frozenset({"localtime", "posixrules"})


def check_zone(name: object) -> str:
    if not isinstance(name, str) or name not in _zones() or name in HOST_ZONES:
        raise InvalidTiming(f"unknown time zone {name!r}; use an IANA name", "timezone")
    return name


def check_interval(seconds: object) -> int:
    if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 1:
        raise InvalidTiming(
            "interval_seconds must be a whole number, at least 1", "interval_seconds"
        )
    if seconds > 366 * 86400:
        raise InvalidTiming("interval_seconds must be at most a year", "interval_seconds")
    return seconds


_ZONES: frozenset[str] | None = None


def _zones() -> frozenset[str]:
    global _ZONES
    if _ZONES is None:
        _ZONES = frozenset(available_timezones())
    return _ZONES


@dataclass(frozen=True)
class Timing:
    """One schedule's rule: `cron` in `zone`, or every `interval` seconds."""

    cron: str | None
    interval: int | None
    zone: str = "UTC"

    def _tz(self) -> ZoneInfo:
        try:
            return ZoneInfo(self.zone)
        except (ZoneInfoNotFoundError, ValueError):
            raise InvalidTiming(f"unknown time zone {self.zone!r}", "timezone") from None

    def _instant(self, local: datetime, tz: ZoneInfo) -> datetime:
        return local.replace(tzinfo=tz, fold=0).astimezone(UTC)

    def _local(self, t: datetime, tz: ZoneInfo) -> datetime:
        return t.astimezone(tz).replace(tzinfo=None, microsecond=0)

    def _iter(self, start_local: datetime) -> croniter:
        return croniter(self.cron, start_local, second_at_beginning=SECONDS_FIRST)

    def next_after(self, t: datetime) -> datetime:
        """The first slot strictly after instant t."""
        if self.interval is not None:
            return t + timedelta(seconds=self.interval)
        tz = self._tz()
        it = self._iter(self._local(t, tz))
        for _ in range(MAX_STEPS):
            slot = self._instant(it.get_next(datetime), tz)
            if slot > t:
                return slot
        raise InvalidTiming(f"no slot of {self.cron!r} after {t}", "cron")

    def prev_at_or_before(self, t: datetime) -> datetime | None:
        """The last cron slot at or before instant t (None if none within reach)."""
        tz = self._tz()
        it = self._iter(self._local(t, tz) + timedelta(seconds=1))
        for _ in range(MAX_STEPS):
            try:
                slot = self._instant(it.get_prev(datetime), tz)
            except Exception:  # croniter gives up searching far into the past
                return None
            if slot <= t:
                return slot
        return None

    def due(
        self, next_fire_at: datetime, now: datetime, keep: int
    ) -> tuple[list[datetime], datetime]:
        """The slots in [next_fire_at, now], at most the latest `keep` of them, oldest
        first, and the slot after now (the schedule's new next_fire_at)."""
        if next_fire_at > now:
            return [], next_fire_at
        if self.interval is not None:
            step = timedelta(seconds=self.interval)
            last = (now - next_fire_at) // step
            first = max(0, last - keep + 1)
            slots = [next_fire_at + k * step for k in range(first, last + 1)]
            return slots, next_fire_at + (last + 1) * step
        slots: list[datetime] = []
        slot = self.prev_at_or_before(now)
        while slot is not None and slot >= next_fire_at and len(slots) < keep:
            slots.append(slot)
            slot = self.prev_at_or_before(slot - timedelta(microseconds=1))
        slots.reverse()
        return slots, self.next_after(now)
