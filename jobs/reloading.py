"""runworker --reload (development): Django's autoreloader, as runserver uses it, around
a worker that stops warm when a Python file changes (D229).

Django's `run_with_reloader` runs the command on a thread and leaves the child with
`sys.exit(3)` from the reloader's thread: the worker's signal handlers need the main
thread and its jobs in flight would be cut off (their leases left to the reaper, a
retry charged). So the parts are used apart: the parent restarts a child that exits
with autoreload's code 3; in the child the worker keeps the main thread and the
reloader watches on a thread of its own, turning a change into the worker's warm stop.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable

from django.utils import autoreload

log = logging.getLogger("jobs.worker")

RESTART_EXIT_CODE = 3  # what Django's autoreloader restarts on


def in_child() -> bool:
    return os.environ.get(autoreload.DJANGO_AUTORELOAD_ENV) == "true"


def supervise() -> int:
    """The parent: run `manage.py runworker ...` as a child, again each time it exits
    with RESTART_EXIT_CODE; any other exit is this process's. SIGTERM is passed on;
    SIGINT (Ctrl-C) reaches the child from the terminal itself."""
    env = {**os.environ, autoreload.DJANGO_AUTORELOAD_ENV: "true"}
    child: subprocess.Popen | None = None

    def forward(signum, _frame) -> None:
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        child = subprocess.Popen(autoreload.get_child_arguments(), env=env, close_fds=False)
        code = child.wait()
        if code != RESTART_EXIT_CODE:
            return code


class Watcher:
    """In the child: Django's reloader on a thread; the first changed file calls `stop`
    (the worker's warm stop) and ends the watch. `changed` says whether one did."""

    def __init__(self, stop: Callable[[], None]) -> None:
        self._stop = stop
        self.changed: str | None = None
        self.reloader = autoreload.get_reloader()
        self._main = threading.main_thread()
        self._thread = threading.Thread(target=self._run, name="reloader", daemon=True)

    def start(self) -> None:
        autoreload.file_changed.connect(self._on_change, dispatch_uid="jobs.reloading")
        self._thread.start()

    def _run(self) -> None:
        log.info("watching for file changes with %s", type(self.reloader).__name__)
        self.reloader.run(self._main)

    def _on_change(self, sender, file_path, **kwargs) -> bool:
        if self.changed is None:
            self.changed = str(file_path)
            log.info("%s changed: stopping the worker warm to reload", file_path)
            self.reloader.stop()
            self._stop()
        return True  # handled: not autoreload's own sys.exit(3) on this thread
