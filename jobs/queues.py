"""The queues a deployment serves: JOBS_QUEUES, parsed here and nowhere else.

JOBS_QUEUES is a JSON object read from the environment whose keys are queue names
and whose values are per-queue settings (default `{"default": {}}`). Only declared
queues accept jobs: a client cannot create queues at will, so per-queue metric labels,
per-queue backpressure and the depth cache stay bounded by this list.
"""

from __future__ import annotations

import json
import re
from typing import Any

from django.core.exceptions import ImproperlyConfigured

DEFAULT = '{"default": {}}'
# Queues of built-in tasks, accepted without being declared (a declaration of the same
# name sets their settings): webhook deliveries (jobs.events).
BUILTIN: dict[str, dict[str, Any]] = {"webhooks": {}}
# Matched whole (fullmatch): `$` would also match before a trailing newline.
QUEUE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}")
# The per-queue settings a queue may carry (their meaning is documented where they are used).
QUEUE_SETTINGS = frozenset({"paused", "concurrency", "rate", "weight"})


def valid_name(name: Any) -> bool:
    return isinstance(name, str) and QUEUE_NAME_RE.fullmatch(name) is not None


def parse(text: str) -> dict[str, dict[str, Any]]:
    """JOBS_QUEUES text → {queue: settings}; ImproperlyConfigured says what is wrong."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ImproperlyConfigured(f"JOBS_QUEUES is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not doc:
        raise ImproperlyConfigured(
            'JOBS_QUEUES must be a non-empty JSON object of queue names, e.g. {"default": {}}'
        )
    for name, conf in doc.items():
        if not valid_name(name):
            raise ImproperlyConfigured(
                f"JOBS_QUEUES: {name!r} is not a queue name "
                "(1-100 letters, digits, '_', '.', ':' or '-', starting with a letter or digit)"
            )
        if not isinstance(conf, dict):
            raise ImproperlyConfigured(
                f"JOBS_QUEUES[{name!r}] must be a JSON object of settings, got {conf!r}"
            )
        unknown = sorted(set(conf) - QUEUE_SETTINGS)
        if unknown:
            raise ImproperlyConfigured(
                f"JOBS_QUEUES[{name!r}] has unknown setting(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(sorted(QUEUE_SETTINGS))}"
            )
    return doc


def with_builtin(doc: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {**doc, **{name: conf for name, conf in BUILTIN.items() if name not in doc}}


def declared() -> dict[str, dict[str, Any]]:
    from django.conf import settings

    return settings.JOBS_QUEUES


def is_declared(name: Any) -> bool:
    return valid_name(name) and name in declared()
