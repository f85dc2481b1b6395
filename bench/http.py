"""HTTP submission through gunicorn (needs the API on this branch)."""

from __future__ import annotations


def not_measured(name: str) -> dict:
    return {
        "scenario": name,
        "figure": "HTTP submission through gunicorn",
        "value": None,
        "unit": "jobs/s",
        "note": "NOT MEASURED: the REST API (jobs/api/) is not on this branch yet",
    }
