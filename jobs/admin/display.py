"""How the admin shows a job's parts: badge, budget, durations, errors, progress.

Markup only carries classes; the look lives in jobs/static/jobs/admin/jobs.css.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.contrib import admin
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

LAST_ERROR_CHARS = 60
LAST_ERROR_TITLE_CHARS = 500


def status_badge_html(status: str) -> str:
    """The state as a coloured pill; its colour comes from the class `job-badge-<state>`."""
    return format_html('<span class="job-badge job-badge-{}">{}</span>', status, status)


def short_duration(value: timedelta | float | None) -> str:
    """'3d 4h', '2h 5m', '4m 10s', '12s' — enough to read at a glance."""
    if value is None:
        return "—"
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    sign = "-" if seconds < 0 else ""
    s = int(abs(seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{sign}{days}d {hours}h"
    if hours:
        return f"{sign}{hours}h {minutes}m"
    if minutes:
        return f"{sign}{minutes}m {s}s"
    return f"{sign}{s}s"


def iso_time(value: datetime | None) -> str:
    """UTC to the millisecond: lease and heartbeat questions need seconds."""
    if value is None:
        return "—"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def time_column(field: str, description: Any, **display: Any) -> Callable[[Any, Any], str]:
    """An admin list/detail column showing one timestamp field as `iso_time` does."""

    def column(admin_self: Any, obj: Any) -> str:
        return iso_time(getattr(obj, field))

    column.__name__ = field
    return admin.display(description=description, **display)(column)


def duration_column(attr: str, description: Any, **display: Any) -> Callable[[Any, Any], str]:
    """A column showing an annotated age (`attr`, set by the list's queryset) in short form."""

    def column(admin_self: Any, obj: Any) -> str:
        return short_duration(getattr(obj, attr, None))

    column.__name__ = attr.lstrip("_")
    return admin.display(description=description, **display)(column)


def percent(share: float | None) -> str:
    """0.6667 → '66.7%' (one decimal, so 94.96% never reads as the 95% target)."""
    if share is None:
        return "—"
    return f"{math.floor(share * 1000 + 1e-9) / 10:.1f}%"  # truncated, never rounded up


def truncate(text: str, limit: int) -> str:
    """First line of `text`, at most `limit` characters; an ellipsis says more was cut."""
    text = text.strip()
    line = text.split("\n", 1)[0]
    if len(line) > limit:
        return line[: limit - 1] + "…"
    return line if line == text else line + " …"


def budget_text(retry_count: int, max_retries: int) -> str:
    """The retry budget in words: "4 attempts (3 retries)" once spent, else how much is used."""
    if retry_count > max_retries:
        retries = retry_count - 1
        # Each number its own plural: "1 attempt (0 retries)", "2 attempts (1 retry)".
        attempts = ngettext("%(n)d attempt", "%(n)d attempts", retry_count) % {"n": retry_count}
        spent = ngettext("%(n)d retry", "%(n)d retries", retries) % {"n": retries}
        return _("%(attempts)s (%(retries)s)") % {"attempts": attempts, "retries": spent}
    return _("%(used)d of %(budget)d retries") % {"used": retry_count, "budget": max_retries}


def last_error_html(error: str | None) -> str:
    """The latest error cut to one short line; its title holds more, the detail page all."""
    if not error:
        return "—"
    return format_html(
        '<span class="job-last-error" title="{}">{}</span>',
        error[:LAST_ERROR_TITLE_CHARS],
        truncate(error, LAST_ERROR_CHARS),
    )


def error_detail_html(
    error: str | None,
    error_class: str | None,
    traceback: str | None,
    *,
    open_traceback: bool = True,
) -> str:
    """An error, its exception class and its traceback (folded unless `open_traceback`)."""
    if not error:
        return "—"
    parts = [format_html('<pre class="job-error">{}</pre>', error)]
    if error_class:
        parts.append(format_html('<div class="job-error-class">{}</div>', error_class))
    if traceback:
        parts.append(
            format_html(
                '<details class="job-traceback"{}><summary>traceback</summary>'
                "<pre>{}</pre></details>",
                " open" if open_traceback else "",
                traceback,
            )
        )
    return format_html_join("", "{}", ((part,) for part in parts))


def pretty_json(value: Any) -> str:
    if value is None:
        return "—"
    return format_html(
        '<pre class="job-json">{}</pre>',
        json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False),
    )


def progress_bar_html(report: dict[str, Any] | None) -> str:
    """A bar when the handler reported a total; the count alone otherwise."""
    if report is None:
        return "—"
    if report["fraction"] is None:
        return f"{report['done']:g}"
    return format_html(
        '<progress class="job-progress" value="{}" max="1" title="{}"></progress> {}%',
        report["fraction"],
        report["message"],
        round(report["fraction"] * 100),
    )


def progress_detail_html(report: dict[str, Any] | None) -> str:
    if report is None:
        return "—"
    total = "?" if report["total"] is None else f"{report['total']:g}"
    share = "" if report["fraction"] is None else f" ({report['fraction']:.0%})"
    return format_html(
        '<div class="job-progress-count">{}</div>'
        '<div class="job-progress-message">{}</div>'
        '<div class="job-progress-at">{}</div>',
        _("%(done)s of %(total)s%(share)s")
        % {"done": f"{report['done']:g}", "total": total, "share": share},
        report["message"] or "—",
        _("reported at %(at)s") % {"at": report["updated_at"] or "—"},
    )
