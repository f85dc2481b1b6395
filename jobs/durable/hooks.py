"""The worker's calls after a write-back ended jobs: push the workflow children their
ends made due."""

from __future__ import annotations

import logging
import threading
import time

from django.db import DatabaseError, InterfaceError

from jobs import selectors, services

log = logging.getLogger(__name__)


class _RunningWorkflows:
    """Whether any workflow is unfinished, read at most every `every` seconds: a worker
    skips the children query while none is (no cost for deployments without them)."""

    def __init__(self, every: float = 2.0) -> None:
        self.every = every
        self._at = float("-inf")
        self._any = False
        self._lock = threading.Lock()

    def __call__(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self.every:
                self._any = selectors.workflows_running()
                self._at = now
            return self._any


running_workflows = _RunningWorkflows()


def after_ends(job_ids: list[int]) -> None:
    """After a write-back ended `job_ids`: push the workflow children their ends made
    due and observe the workflows they finished (jobs.services.signal_woken_children).
    A failure only delays the children to the next poll."""
    if not job_ids:
        return
    try:
        if running_workflows():
            services.signal_woken_children(job_ids)
    except (DatabaseError, InterfaceError) as exc:
        log.warning("could not signal workflow children (polling finds them): %s", exc)
