"""Group commit: concurrent callers' writes in one transaction and one WAL flush (D385).

A caller queues its request and waits. The first caller finding no batch in flight
leads: it takes every request queued, writes them with one statement on its own
connection (autocommit: one transaction, one flush), answers each, and hands the lead
to the oldest request queued meanwhile, whose thread writes the next batch on its own
connection. A lone caller writes at once (a batch of one), so nothing waits for a
timer; batches grow only when callers overlap. Each caller still returns only after
its own write committed. A request the batch could not settle (the batch failed, or
its row came back refused) is written again alone by its own thread, so its answer
and its errors are exactly those of the single write.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)
R = TypeVar("R")

_WAIT, _DONE, _LEAD, _ALONE = range(4)


class _Request:
    __slots__ = ("item", "state", "answer", "event")

    def __init__(self, item: Any) -> None:
        self.item = item
        self.state = _WAIT
        self.answer: Any = None
        self.event = threading.Event()


class GroupCommit(Generic[R]):
    """`one(item)` writes a request alone; `many(items)` writes a batch and returns, per
    item, its answer or None (not settled by the batch: written again alone)."""

    def __init__(
        self,
        one: Callable[[Any], R],
        many: Callable[[Sequence[Any]], Sequence[R | None]],
        max_batch: int = 256,
    ) -> None:
        self._one = one
        self._many = many
        self._max = max_batch
        self._lock = threading.Lock()
        self._queued: list[_Request] = []
        self._leading = False

    def write(self, item: Any) -> R:
        req = _Request(item)
        with self._lock:
            self._queued.append(req)
            lead = not self._leading
            self._leading = True
        if not lead:
            req.event.wait()
            if req.state != _LEAD:
                return req.answer if req.state == _DONE else self._one(item)
        return self._lead(req)

    def _lead(self, own: _Request) -> R:
        """Write the queued requests (`own` first) as one batch, answer them, pass the
        lead on; then `own`'s answer."""
        with self._lock:
            batch, self._queued = self._queued[: self._max], self._queued[self._max :]
        try:
            if len(batch) == 1:  # alone: the single write, its errors raised here
                own.answer, own.state = self._one(own.item), _DONE
            else:
                try:
                    answers = self._many([r.item for r in batch])
                except Exception as exc:
                    log.info("a batch of %d writes failed (%s): each is written alone",
                             len(batch), exc)  # fmt: skip
                    answers = [None] * len(batch)  # each writes alone, meets its own error
                for r, a in zip(batch, answers, strict=True):
                    r.answer, r.state = a, (_ALONE if a is None else _DONE)
        finally:
            with self._lock:
                if self._queued:
                    nxt = self._queued[0]
                    nxt.state = _LEAD
                    nxt.event.set()
                else:
                    self._leading = False
            for r in batch:
                if r is not own:
                    r.event.set()
        return own.answer if own.state == _DONE else self._one(own.item)
