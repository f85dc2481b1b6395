"""The flow fields of a submission and their rules (jobs.submission applies them).

`debounce_key` + `debounce_seconds` (+ `debounce_max_wait`): gather submissions into
one job. `key_strategy`: what a new job does when its `concurrency_key` is busy.
`rate_limit`: refuse submissions of the key past N per period. Each refusal is an
InvalidSubmission naming its field (a JSON 400).
"""

from __future__ import annotations

import re
from typing import Any

from jobs import queues
from jobs.exceptions import InvalidSubmission

FIELDS = ("debounce_key", "debounce_seconds", "debounce_max_wait", "key_strategy", "rate_limit")
KEY_RE = re.compile(r"[\x21-\x7e]{1,200}")  # as every key of a job: printable ASCII
DEBOUNCE_SECONDS_MAX = 86400.0
DEBOUNCE_MAX_WAIT_MAX = 7 * 86400.0
QUEUE, CANCEL_RUNNING, SKIP_NEW = "queue", "cancel_running", "skip_new"
STRATEGIES = (QUEUE, CANCEL_RUNNING, SKIP_NEW)


# Each field's refusal code, named in full: a `codes` map is what the README's
# table of error codes is checked against (tests/api/test_error_codes.py).
codes = {
    "debounce_key": "invalid_debounce_key",
    "debounce_seconds": "invalid_debounce_seconds",
    "debounce_max_wait": "invalid_debounce_max_wait",
    "key_strategy": "invalid_key_strategy",
    "rate_limit": "invalid_rate_limit",
}


def _seconds(name: str, value: Any, top: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= top:
        raise InvalidSubmission(
            f"{name} must be a number of seconds > 0 and at most {top:g}",
            field=name,
            code=codes[name],
        )
    return float(value)


def check(item: dict[str, Any]) -> None:
    """Normalise the flow fields of `item` in place (absent ones become None) or raise
    InvalidSubmission for the first rule broken."""
    for name in FIELDS:
        item.setdefault(name, None)
    key = item["debounce_key"]
    if key is not None:
        if not isinstance(key, str) or not KEY_RE.fullmatch(key):
            raise InvalidSubmission(
                "debounce_key must be 1-200 printable ASCII characters without spaces",
                field="debounce_key",
                code="invalid_debounce_key",
            )
        if item["debounce_seconds"] is None:
            raise InvalidSubmission(
                "debounce_key needs debounce_seconds", field="debounce_seconds", code="required"
            )
        for other in ("run_at", "idempotency_key", "unique_key"):
            if item.get(other) is not None:
                raise InvalidSubmission(
                    f"debounce_key decides when the job runs and which one a submission "
                    f"joins: it cannot be combined with {other}",
                    field="debounce_key",
                    code="invalid_debounce_key",
                )
    for name in ("debounce_seconds", "debounce_max_wait"):
        if item[name] is not None and key is None:
            raise InvalidSubmission(f"{name} needs debounce_key", field=name, code=codes[name])
    if item["debounce_seconds"] is not None:
        item["debounce_seconds"] = _seconds(
            "debounce_seconds", item["debounce_seconds"], DEBOUNCE_SECONDS_MAX
        )
    if item["debounce_max_wait"] is not None:
        wait = _seconds("debounce_max_wait", item["debounce_max_wait"], DEBOUNCE_MAX_WAIT_MAX)
        if wait < item["debounce_seconds"]:
            raise InvalidSubmission(
                "debounce_max_wait must be at least debounce_seconds",
                field="debounce_max_wait",
                code="invalid_debounce_max_wait",
            )
        item["debounce_max_wait"] = wait
    strategy = item["key_strategy"]
    if strategy is not None and strategy not in STRATEGIES:
        raise InvalidSubmission(
            f"key_strategy must be one of {', '.join(STRATEGIES)}",
            field="key_strategy",
            code="invalid_key_strategy",
        )
    if item["rate_limit"] is not None:
        try:
            item["rate_limit"] = queues.parse_key_rate(item["rate_limit"], "rate_limit")
        except ValueError as exc:
            raise InvalidSubmission(
                str(exc), field="rate_limit", code="invalid_rate_limit"
            ) from None
    for name in ("key_strategy", "rate_limit"):
        if item[name] is not None and item.get("concurrency_key") is None:
            raise InvalidSubmission(
                f"{name} applies to a concurrency_key: give one",
                field=name,
                code=codes[name],
            )


def wanted(item: dict[str, Any]) -> bool:
    """The submission asks for flow control (else it takes the plain path)."""
    return (
        item.get("debounce_key") is not None
        or item.get("rate_limit") is not None
        or item.get("key_strategy") not in (None, QUEUE)
    )
