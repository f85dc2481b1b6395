"""Retention by partition and its Parquet archive (issue 33): `files` (pyarrow),
`tables` (PostgreSQL: periods, DETACH, DROP, ATTACH), `retention` (prunejobs),
`restore` (manage.py archive).

`jobs.archive.archive_expired(older_than_seconds, archive_dir)` is retention's entry
for scripts and benchmarks; it is loaded on first use, so `files` imports without
Django's app registry.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("archive_expired", "Report", "ArchiveStopped"):
        from jobs.archive import retention

        return getattr(retention, name)
    raise AttributeError(name)
