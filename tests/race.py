"""Concurrency in tests: one function in n threads, released together, each thread on
database connections of its own (closed when it ends)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db import connections


def race(n: int, fn: Callable[[int, Callable[[], Any]], Any]) -> list[Any]:
    """Run fn(i, go) in n threads; each calls go() once ready, and all go on together.

    Returns each thread's result in order; fails with every error a thread hit.
    """
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = fn(i, lambda: barrier.wait(timeout=30))
        except BaseException as exc:  # reported by the assertion below
            results[i] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    return results
