"""The deployment's front, HAProxy as `python -m jobservice.proxy` starts it, on a free
loopback port in front of an API server of the caller's: the slow-client tests and the
bench reach the API through it as a client of the deployment would.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.procs import ROOT, Service, free_port, http_ok, wait_until

BINARY = "haproxy"


def available() -> str | None:
    """None when HAProxy can be started here, else why not."""
    if shutil.which(BINARY) is None and not Path(f"/usr/sbin/{BINARY}").exists():
        return "haproxy is not installed (make tools installs the Debian package haproxy)"
    return None


class Front:
    """`python -m jobservice.proxy` with its files in a directory of its own; `env` is
    the app's environment (the launcher reads the app's body bound) plus PROXY_* values."""

    def __init__(self, upstream_port: int, env: dict[str, str], root: Path = ROOT) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="front-"))
        self.service = Service(
            "haproxy",
            [sys.executable, "-m", "jobservice.proxy"],
            {
                **env,
                "PROXY_LISTEN": f"127.0.0.1:{self.port}",
                "PROXY_UPSTREAM": f"127.0.0.1:{upstream_port}",
                "PROXY_DIR": str(self.dir / "run"),
                "PROXY_THREADS": env.get("PROXY_THREADS", "1"),
            },
            self.dir / "haproxy.log",
            cwd=root,
        )

    def start(self, timeout: float = 30) -> Front:
        self.service.start()
        wait_until(lambda: http_ok(self.port, "/proxy-healthz") or not self.service.alive(),
                   timeout, "the front to answer /proxy-healthz", interval=0.1)  # fmt: skip
        if not self.service.alive():
            raise RuntimeError(f"the front exited:\n{self.log()}")
        return self

    def log(self) -> str:
        return self.service.output()

    def stop(self) -> int | None:
        """HAProxy's soft stop (SIGUSR1: stop listening, finish what is in flight, exit 0,
        bounded by hard-stop-after); the exit code."""
        if self.service.alive():
            self.service.signal(signal.SIGUSR1)
            try:
                self.service.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        code = self.service.stop(10)
        shutil.rmtree(self.dir, ignore_errors=True)
        return code
