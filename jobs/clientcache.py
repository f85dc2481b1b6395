"""Active API clients by token hash, cached so a request needs no client query.

Shared across processes (the `api_clients` cache: Redis when REDIS_URL is set, else
none), for JOBS_CLIENT_CACHE_SECONDS. Revocation is immediate: every change to a
client (save, delete, `services.deactivate_clients`) first writes a tombstone for its
hash, and readers only ever *add* an entry, so a reader that fetched the row before
the change cannot put the stale client back. A cache that fails is skipped (the
database answers); a tombstone that cannot be written leaves at most the TTL of
staleness, and is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from django.core.cache import caches
from django.core.cache.backends.dummy import DummyCache
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from jobs.conf import settings
from jobs.models import Client

log = logging.getLogger(__name__)

ALIAS = "api_clients"
_TOMBSTONE = "-"
_NO_CACHE = DummyCache("", {})


def _cache():
    """The `api_clients` cache, or none when the project declares no such cache."""
    if ALIAS not in settings.CACHES:
        return _NO_CACHE
    return caches[ALIAS]


def active_client(token_hash: str) -> Client | None:
    """The client with this token hash (active or not), or None: cached when active."""
    try:
        hit = _cache().get(token_hash)
    except Exception:  # the cache is an optimisation: the database answers
        hit = _TOMBSTONE  # and a cache that just failed is not written to (one timeout)
    if isinstance(hit, tuple):
        pk, name = hit
        client = Client(pk=pk, name=name, token_hash=token_hash, is_active=True)
        client._state.adding = False
        client._state.db = "default"
        return client
    client = Client.objects.filter(token_hash=token_hash).first()
    if client is not None and client.is_active and hit is None:
        try:
            _cache().add(token_hash, (client.pk, client.name), settings.JOBS_CLIENT_CACHE_SECONDS)
        except Exception:
            pass
    return client


def forget(token_hashes: Iterable[str]) -> None:
    """Tombstone these hashes for a TTL: the next requests read the database."""
    hashes = list(token_hashes)
    if not hashes:
        return
    try:
        _cache().set_many(
            dict.fromkeys(hashes, _TOMBSTONE), timeout=settings.JOBS_CLIENT_CACHE_SECONDS
        )
    except Exception:
        log.warning(
            "client cache unavailable: a changed client may be served from the cache "
            "for up to %s s",
            settings.JOBS_CLIENT_CACHE_SECONDS,
            exc_info=True,
        )


@receiver(post_save, sender=Client, dispatch_uid="jobs.clientcache.saved")
@receiver(post_delete, sender=Client, dispatch_uid="jobs.clientcache.deleted")
def _client_changed(sender, instance: Client, created: bool = False, **kwargs) -> None:
    if not created:  # a new client's hash was never cached (only active clients are)
        forget([instance.token_hash])
