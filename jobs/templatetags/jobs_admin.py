"""Formatting for the admin's job pages."""

from __future__ import annotations

from django import template

register = template.Library()


@register.filter
def duration(seconds: float | None) -> str:
    """Seconds as people read them: sub-second latencies in milliseconds, not "0.0 s"."""
    if seconds is None:
        return "—"
    seconds = float(seconds)
    if round(seconds * 1000) < 1000:
        ms = seconds * 1000
        return f"{ms:.1f} ms" if 0 < ms < 10 else f"{ms:.0f} ms"
    return f"{seconds:.1f} s"
