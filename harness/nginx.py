"""The deployment's front, nginx as `python -m jobservice.proxy` starts it, on a free
loopback port in front of an API server of the caller's: the slow-client tests and the
bench reach the API through it as a client of the deployment would.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from harness.procs import ROOT, Service, free_port, http_ok, wait_until

BINARY = "nginx"


def available() -> str | None:
    """None when nginx can be started here, else why not."""
    if shutil.which(BINARY) is None and not Path(f"/usr/sbin/{BINARY}").exists():
        return "nginx is not installed (make tools installs the Debian package nginx-light)"
    return None


class Nginx:
    """`python -m jobservice.proxy` with its files in a directory of its own; `env` is
    the app's environment (the launcher reads the app's body bound) plus PROXY_* values."""

    def __init__(self, upstream_port: int, env: dict[str, str], root: Path = ROOT) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="nginx-"))
        self.service = Service(
            "nginx",
            [sys.executable, "-m", "jobservice.proxy"],
            {
                **env,
                "PROXY_LISTEN": f"127.0.0.1:{self.port}",
                "PROXY_UPSTREAM": f"127.0.0.1:{upstream_port}",
                "PROXY_DIR": str(self.dir / "run"),
                "PROXY_WORKER_PROCESSES": env.get("PROXY_WORKER_PROCESSES", "1"),
            },
            self.dir / "nginx.log",
            cwd=root,
        )

    def start(self, timeout: float = 30) -> Nginx:
        self.service.start()
        wait_until(lambda: http_ok(self.port, "/proxy-healthz") or not self.service.alive(),
                   timeout, "nginx to answer /proxy-healthz", interval=0.1)  # fmt: skip
        if not self.service.alive():
            raise RuntimeError(f"nginx exited:\n{self.log()}")
        return self

    def log(self) -> str:
        return self.service.output()

    def stop(self) -> int | None:
        """nginx's fast shutdown (SIGTERM); the exit code."""
        code = self.service.stop(10)
        shutil.rmtree(self.dir, ignore_errors=True)
        return code
