"""The queues a deployment serves: JOBS_QUEUES, parsed here and nowhere else.

JOBS_QUEUES is a dict (or a JSON object read from the environment) whose keys are queue names
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
# name sets their settings): webhook deliveries (jobs.events). They are the service's own:
# internal whatever their declaration says (D197).
BUILTIN: dict[str, dict[str, Any]] = {"webhooks": {}}
# Matched whole (fullmatch): `$` would also match before a trailing newline.
QUEUE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}")
# The per-queue settings a queue may carry (docs/queue-controls.md says what each does).
QUEUE_SETTINGS = frozenset(
    {"paused", "concurrency", "rate", "weight", "fair", "key_concurrency", "key_rate", "internal"}
)
# At most 1000 starts per period: the claim keeps each start of the window in the row.
RATE_RE = re.compile(r"([1-9][0-9]{0,2}|1000)/([smh])")
RATE_PERIODS = {"s": 1, "m": 60, "h": 3600}
MAX_WEIGHT = 1000  # as runworker --queues accepts
# A key's rate (a queue's `key_rate`, a submission's `rate_limit`): starts or submissions
# per period of whole seconds. Each counted event is a row of jobs_keyhit.
KEY_RATE_LIMIT_MAX = 1000
KEY_RATE_PERIOD_MAX = 86400


def parse_rate(text: Any) -> tuple[int, int]:
    """`N/s`, `N/m` or `N/h` → (starts, period in seconds); ValueError says what is wrong."""
    match = RATE_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"rate must look like 5/s, 100/m or 1000/h (N from 1 to 1000), got {text!r}"
        )
    return int(match[1]), RATE_PERIODS[match[2]]


def parse_key_rate(value: Any, name: str = "key_rate") -> tuple[int, int]:
    """`{"limit": N, "period": S}` → (N, S); ValueError says what is wrong."""
    ok = isinstance(value, dict) and set(value) == {"limit", "period"}
    limit, period = (value.get("limit"), value.get("period")) if ok else (None, None)
    for number, top in ((limit, KEY_RATE_LIMIT_MAX), (period, KEY_RATE_PERIOD_MAX)):
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= top:
            ok = False
    if not ok:
        raise ValueError(
            f'{name} must be {{"limit": N, "period": S}} with N from 1 to {KEY_RATE_LIMIT_MAX} '
            f"and S whole seconds from 1 to {KEY_RATE_PERIOD_MAX}, got {value!r}"
        )
    return limit, period


def format_key_rate(limit: int | None, period: int | None) -> str:
    return "" if limit is None or period is None else f"{limit}/{period}s per key"


def format_rate(limit: int | None, period: int | None) -> str:
    if limit is None or period is None:
        return ""
    unit = {v: k for k, v in RATE_PERIODS.items()}.get(period)
    return f"{limit}/{unit}" if unit else f"{limit}/{period}s"


def _check_value(key: str, value: Any) -> None:
    """Raise ValueError unless `value` is a valid `key` setting (null clears a limit)."""
    if key in ("paused", "fair", "internal"):
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
    elif key in ("concurrency", "key_concurrency"):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100_000
        ):
            raise ValueError(f"{key} must be a whole number 1-100000 or null, got {value!r}")
    elif key == "rate":
        if value is not None:
            parse_rate(value)
    elif key == "key_rate":
        if value is not None:
            parse_key_rate(value)
    elif key == "weight":
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value <= MAX_WEIGHT
        ):
            raise ValueError(f"weight must be a number in (0, {MAX_WEIGHT}], got {value!r}")


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
        for key, value in conf.items():
            try:
                _check_value(key, value)
            except ValueError as exc:
                raise ImproperlyConfigured(f"JOBS_QUEUES[{name!r}]: {exc}") from None
    return doc


def with_builtin(doc: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {**doc, **{name: conf for name, conf in BUILTIN.items() if name not in doc}}


_parsed: tuple[Any, dict[str, dict[str, Any]]] = (None, {})


def from_setting(value: Any) -> dict[str, dict[str, Any]]:
    """JOBS_QUEUES as a project holds it (a dict, or JSON text from the environment)
    → {queue: settings} with the built-in queues; ImproperlyConfigured says what is wrong."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ImproperlyConfigured(f"JOBS_QUEUES is not JSON-like: {exc}") from None
    return with_builtin(parse(text or DEFAULT))


def declared() -> dict[str, dict[str, Any]]:
    """The declared queues, parsed again only when the setting is another object."""
    global _parsed
    from jobs.conf import settings

    raw = settings.JOBS_QUEUES
    if _parsed[0] is not raw:
        _parsed = (raw, from_setting(raw))
    return _parsed[1]


def names_for_docs() -> list[str]:
    """The queues clients may submit to, for the API schema, read at import: none while
    JOBS_QUEUES is malformed, so that `check` reports it (jobs.E103) instead of an import
    traceback."""
    try:
        return open_names()
    except ImproperlyConfigured:
        return []


def is_declared(name: Any) -> bool:
    return valid_name(name) and name in declared()


def is_internal(name: str) -> bool:
    """The service's own queue (a built-in one) or one an operator marked `"internal":
    true`: code may submit to it, a client may not (D197)."""
    return _internal(name, declared().get(name, {}))


def _internal(name: str, declared_as: dict[str, Any]) -> bool:
    return name in BUILTIN or declared_as.get("internal") is True


def refusal(name: Any, *, for_client: bool = False) -> str | None:
    """Why a submission may not name this queue, or None: "invalid" (not a queue name),
    "unknown" (not declared, or internal and asked by a client: D197). One look-up for
    the submission's rules (jobs.validation)."""
    if not valid_name(name):
        return "invalid"
    found = declared().get(name)
    if found is None or (for_client and _internal(name, found)):
        return "unknown"
    return None


def open_names() -> list[str]:
    """The declared queues a client may submit to."""
    return [name for name in declared() if not is_internal(name)]
