"""Names, secrets and signatures of completion events (Standard Webhooks).

A webhook's secret is never stored: it is HMAC(JOBS_WEBHOOK_KEY, salt), and only
the random salt is in the database, so a read of the database alone cannot
forge a signature. Rotating JOBS_WEBHOOK_KEY therefore rotates every secret
(decision D71). Signing itself is the `standardwebhooks` package's.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from datetime import datetime

from standardwebhooks.webhooks import Webhook as Signer

from jobs.conf import settings

# The built-in delivery task and the queue it runs on (always declared, served by
# a default runworker).
WEBHOOK_QUEUE = "webhooks"
DELIVER_TASK = "webhook.deliver"
# The lifecycle event types a webhook may ask for; "*" is every one of them.
EVENT_PREFIX = "job."
ALL_EVENTS = "*"
SECRET_PREFIX = "whsec_"


def event_types() -> list[str]:
    from jobs.lifecycle import STATUSES

    return [EVENT_PREFIX + s for s in STATUSES]


def event_type(to_status: str) -> str:
    return EVENT_PREFIX + to_status


def message_id(event_id: int) -> str:
    """The Standard Webhooks message id of a history row: the same on every attempt,
    every endpoint and the Redis stream, so consumers dedupe on it."""
    return f"evt_{event_id}"


def new_salt() -> str:
    return secrets.token_hex(16)


def _key() -> bytes:
    key = settings.JOBS_WEBHOOK_KEY
    return key.encode()


def secret_for(salt: str) -> str:
    """`whsec_<base64 of 24 bytes>`, derived from the salt and JOBS_WEBHOOK_KEY."""
    raw = hmac.new(_key(), f"webhook-secret:{salt}".encode(), hashlib.sha256).digest()[:24]
    return SECRET_PREFIX + base64.b64encode(raw).decode()


def sign(salt: str, msg_id: str, timestamp: datetime, body: str) -> dict[str, str]:
    """The three Standard Webhooks headers for one attempt."""
    signature = Signer(secret_for(salt)).sign(msg_id, timestamp, body)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(timestamp.timestamp())),
        "webhook-signature": signature,
    }
