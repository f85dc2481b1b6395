"""Redis as transport only (SPEC §1): lists of job ids, one per queue.

The only module that imports redis. A message is a wake-up hint, never a fact;
losing every message may delay work but never lose or change a job.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

import redis
from django.core.cache.backends.redis import RedisCache as DjangoRedisCache
from django.core.cache.backends.redis import RedisCacheClient
from redis.backoff import NoBackoff
from redis.retry import Retry

from jobs import metrics
from jobs.conf import settings

log = logging.getLogger(__name__)

# Short socket timeouts: a dead or frozen Redis must not stall the API.
CONNECT_TIMEOUT = 0.5
SOCKET_TIMEOUT = 2.0


# Appends the outbox's entries (`evt_<history id>`, in history order) newer than the
# stream's last entry: the dispatcher moves its cursor after the XADDs, so a crash
# between them repeats a batch, and the stream's own tail says what is already in it.
_APPEND_EVENTS_LUA = """
local last = 0
local tail = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if tail[1] then
  local f = tail[1][2]
  for i = 1, #f, 2 do
    if f[i] == 'id' then last = tonumber(string.sub(f[i + 1], 5)) or 0 end
  end
end
local added = 0
for i = 2, #ARGV, 3 do
  local n = tonumber(string.sub(ARGV[i], 5)) or 0
  if n > last then
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*',
               'id', ARGV[i], 'type', ARGV[i + 1], 'body', ARGV[i + 2])
    last = n
    added = added + 1
  end
end
return added
"""


class TransportError(Exception):
    """Redis could not be reached or refused the command."""


class Transport:
    """Pushes and pops job ids on Redis lists named `<prefix>q:<queue>`."""

    enabled = True

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix
        self._client = redis.Redis.from_url(
            url,
            socket_connect_timeout=CONNECT_TIMEOUT,
            socket_timeout=SOCKET_TIMEOUT,
            retry=Retry(NoBackoff(), 0),  # callers decide when to try again
            health_check_interval=15,
        )
        self._blmpop = True  # falls back to BLPOP + LPOP on servers older than 7.0

    def key(self, queue: str) -> str:
        return f"{self.prefix}q:{queue}"

    def _fail(self, op: str, exc: Exception) -> TransportError:
        metrics.REDIS_ERRORS.labels(op=op).inc()
        return TransportError(f"redis {op} failed: {exc.__class__.__name__}: {exc}")

    def push(self, ids_by_queue: dict[str, Sequence[int]]) -> None:
        """RPUSH every id to its queue's list in one round trip."""
        todo = [(queue, ids) for queue, ids in ids_by_queue.items() if ids]
        if not todo:
            return
        try:
            if len(todo) == 1:  # one command needs no pipeline (a single submission's push)
                self._client.rpush(self.key(todo[0][0]), *todo[0][1])
                return
            pipe = self._client.pipeline(transaction=False)
            for queue, ids in todo:
                pipe.rpush(self.key(queue), *ids)
            pipe.execute()
        except redis.RedisError as exc:
            raise self._fail("push", exc) from exc

    def pop(self, queues: Sequence[str], timeout: float, count: int) -> tuple[str, list[int]]:
        """Take up to `count` ids from the first non-empty list, earlier queues first.

        Blocks up to `timeout` s for the first id; `timeout <= 0` does not block.
        Returns (queue, ids), with ids empty when nothing came.
        """
        keys = [self.key(q) for q in queues]
        try:
            if timeout > 0 and self._blmpop:
                # One round trip for up to `count` ids (Redis >= 7.0).
                try:
                    got = self._client.blmpop(
                        min(timeout, SOCKET_TIMEOUT - 0.5),
                        len(keys),
                        *keys,
                        direction="LEFT",
                        count=count,
                    )
                except redis.ResponseError as exc:
                    if "unknown command" not in str(exc).lower():
                        raise
                    self._blmpop = False
                    return self.pop(queues, timeout, count)
                if not got:
                    return "", []
                key, more = got
                ids = [int(x) for x in more]
            elif timeout > 0:
                # Stay under the socket timeout, so a frozen Redis reads as an error.
                got = self._client.blpop(keys, timeout=min(timeout, SOCKET_TIMEOUT - 0.5))
                if got is None:
                    return "", []
                key, first = got
                ids = [int(first)]
                if count > 1:
                    ids.extend(int(x) for x in self._client.lpop(key, count - 1) or ())
            elif self._blmpop and len(keys) > 1:
                got = self._client.lmpop(len(keys), *keys, direction="LEFT", count=count)
                if not got:
                    return "", []
                key, more = got
                ids = [int(x) for x in more]
            else:
                for key in keys:
                    more = self._client.lpop(key, count)
                    if more:
                        break
                else:
                    return "", []
                ids = [int(x) for x in more]
            queue = (key.decode() if isinstance(key, bytes) else key)[len(self.prefix) + 2 :]
            return queue, ids
        except redis.RedisError as exc:
            raise self._fail("pop", exc) from exc

    def lengths(self, queues: Iterable[str]) -> dict[str, int]:
        queues = list(queues)
        try:
            pipe = self._client.pipeline(transaction=False)
            for q in queues:
                pipe.llen(self.key(q))
            return dict(zip(queues, pipe.execute(), strict=True))
        except redis.RedisError as exc:
            raise self._fail("llen", exc) from exc

    def append_events(self, entries: Sequence[dict[str, str]], maxlen: int) -> int:
        """XADD to `<prefix>events` (trimmed to about `maxlen`) every entry newer than the
        stream's last, in one atomic script: the stream the outbox publishes for internal
        consumers (jobs.events). A batch repeated after a dispatcher died between its
        XADDs and its cursor's commit is skipped, not added twice. Returns how many were
        added."""
        if not entries:
            return 0
        args = [str(maxlen)]
        for fields in entries:
            args += [fields["id"], fields["type"], fields["body"]]
        try:
            return int(self._append_events_script(keys=[f"{self.prefix}events"], args=args))
        except redis.RedisError as exc:
            raise self._fail("xadd", exc) from exc

    @property
    def _append_events_script(self):
        script = getattr(self, "_append_script", None)
        if script is None:
            script = self._append_script = self._client.register_script(_APPEND_EVENTS_LUA)
        return script

    def set_flag(self, name: str, ttl_ms: int) -> None:
        """`<prefix><name>` set for `ttl_ms` (jobs.events.backlog)."""
        try:
            self._client.set(f"{self.prefix}{name}", b"1", px=ttl_ms)
        except redis.RedisError as exc:
            raise self._fail("set", exc) from exc

    def clear_flag(self, name: str) -> None:
        try:
            self._client.delete(f"{self.prefix}{name}")
        except redis.RedisError as exc:
            raise self._fail("del", exc) from exc

    def flag(self, name: str) -> bool:
        try:
            return bool(self._client.exists(f"{self.prefix}{name}"))
        except redis.RedisError as exc:
            raise self._fail("exists", exc) from exc

    def publish(self, channel: str, message: str) -> None:
        """PUBLISH a hint to the subscribers of `channel` (jobs.waiting)."""
        try:
            self._client.publish(channel, message)
        except redis.RedisError as exc:
            raise self._fail("publish", exc) from exc

    def subscribe(self, channel: str):
        """A pub/sub subscription to `channel` on a connection of its own."""
        try:
            subscription = self._client.pubsub(ignore_subscribe_messages=True)
            subscription.subscribe(channel)
            return subscription
        except redis.RedisError as exc:
            raise self._fail("subscribe", exc) from exc

    def state(self) -> str:
        try:
            self._client.ping()
            return "ok"
        except redis.RedisError as exc:
            metrics.REDIS_ERRORS.labels(op="ping").inc()
            return f"down: {exc.__class__.__name__}"


class NullTransport:
    """No Redis configured: pushes are no-ops, workers find work by polling Postgres."""

    enabled = False
    prefix = ""

    def push(self, ids_by_queue: dict[str, Sequence[int]]) -> None:
        return None

    def pop(self, queues: Sequence[str], timeout: float, count: int) -> tuple[str, list[int]]:
        if timeout > 0:
            threading.Event().wait(timeout)
        return "", []

    def lengths(self, queues: Iterable[str]) -> dict[str, int]:
        return {}

    def set_flag(self, name: str, ttl_ms: int) -> None:
        return None

    def clear_flag(self, name: str) -> None:
        return None

    def flag(self, name: str) -> bool:
        return False

    def publish(self, channel: str, message: str) -> None:
        return None

    def subscribe(self, channel: str) -> None:
        return None  # waiters find ended jobs by their fallback poll

    def state(self) -> str:
        return "disabled"


_lock = threading.Lock()
_transport: Transport | NullTransport | None = None
_transport_key: tuple[str, str] | None = None


def get_transport() -> Transport | NullTransport:
    """The process-wide transport for the current settings."""
    global _transport, _transport_key
    key = (settings.REDIS_URL, settings.JOBS_REDIS_PREFIX)
    with _lock:
        if _transport is None or _transport_key != key:
            _transport = Transport(*key) if key[0] else NullTransport()
            _transport_key = key
        return _transport


class _OneClientPerPool(RedisCacheClient):
    """Django's Redis cache client builds a `redis.Redis` per call (about 6 % of a
    single submission's CPU in the API); one per connection pool is enough, since a
    `redis.Redis` is safe to share between threads."""

    def get_client(self, key=None, *, write=False):
        index = self._get_connection_pool_index(write)
        clients = self.__dict__.setdefault("_clients_by_pool", {})
        client = clients.get(index)
        if client is None:
            client = clients[index] = self._client(connection_pool=self._get_connection_pool(write))
        return client


class RedisCache(DjangoRedisCache):
    """Django's Redis cache backend (the API clients cache), its client kept per pool."""

    def __init__(self, server, params) -> None:
        super().__init__(server, params)
        self._class = _OneClientPerPool

    def make_and_validate_key(self, key, version=None):
        """The key without memcached's portability warnings: this cache's keys are token
        hashes (64 hex digits), and the check cost as much as the Redis round trip's
        Python side on every API request."""
        return self.make_key(key, version=version)
