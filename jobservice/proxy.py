"""The API's front: `python -m jobservice.proxy` renders deploy/nginx/nginx.conf.template
from the environment and runs nginx in the foreground, as the user it is started as
(D204). `--check` renders and asks `nginx -t` instead; `--print` shows the config.

nginx buffers each request whole before the app sees it and holds the read deadlines
granian lacks (D205): see docs/operations.md "The front".
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
TEMPLATE = BASE_DIR / "deploy" / "nginx" / "nginx.conf.template"
BINARY = "nginx"
# Requests the proxy holds in memory before it spills a body to a temp file: a single
# submission at the default payload bound fits.
BODY_BUFFER_BYTES = 1 << 20
# A client connection's descriptor, its upstream one, and a temp file each.
FDS_PER_CONNECTION = 3

# (environment variable, default): every value the template names, in its units.
DEFAULTS = {
    "PROXY_LISTEN": "0.0.0.0:8080",
    "PROXY_UPSTREAM": "127.0.0.1:8000",
    "PROXY_DIR": "/tmp/jobservice-proxy",
    "PROXY_WORKER_PROCESSES": "auto",
    "PROXY_WORKER_CONNECTIONS": "16384",
    "PROXY_HEADER_TIMEOUT": "10",
    "PROXY_BODY_TIMEOUT": "10",
    "PROXY_SEND_TIMEOUT": "30",
    "PROXY_UPSTREAM_KEEPALIVE": "32",
    "PROXY_ACCESS_LOG": "",
    "PROXY_ERROR_LOG_LEVEL": "warn",
}


def max_body_bytes() -> int:
    """The largest body any path of the app accepts: the batch bound (jobs.api.parsers)."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "jobservice.settings")
    django.setup()
    from jobs.api.parsers import BATCH_BODY_FACTOR
    from jobs.api.parsers import max_body_bytes as single

    return BATCH_BODY_FACTOR * single()


def values(env: dict[str, str] | os._Environ = os.environ, body_bytes: int | None = None) -> dict:
    """The template's values from `env` (PROXY_*, and WEB_KEEPALIVE/WEB_TIMEOUT, which
    bound the upstream side as granian applies them)."""
    get = {k: env.get(k) or default for k, default in DEFAULTS.items()}
    keepalive = int(env.get("WEB_KEEPALIVE") or 5)
    connections, nofile = descriptors(int(get["PROXY_WORKER_CONNECTIONS"]))
    access = get["PROXY_ACCESS_LOG"]
    return {
        "LISTEN": get["PROXY_LISTEN"],
        "UPSTREAM": get["PROXY_UPSTREAM"],
        "DIR": get["PROXY_DIR"],
        "WORKER_PROCESSES": get["PROXY_WORKER_PROCESSES"],
        "WORKER_CONNECTIONS": connections,
        "RLIMIT_NOFILE": nofile,
        "BACKLOG": min(connections, 65535),
        "HEADER_TIMEOUT": int(get["PROXY_HEADER_TIMEOUT"]),
        "BODY_TIMEOUT": int(get["PROXY_BODY_TIMEOUT"]),
        # A kept-alive client waits for its next request at most as long as a new one
        # may take to send its headers.
        "KEEPALIVE": int(get["PROXY_HEADER_TIMEOUT"]),
        "SEND_TIMEOUT": int(get["PROXY_SEND_TIMEOUT"]),
        "UPSTREAM_KEEPALIVE": int(get["PROXY_UPSTREAM_KEEPALIVE"]),
        # Below granian's idle bound (WEB_KEEPALIVE, D202): nginx drops a kept-alive
        # upstream connection before granian closes it under a request.
        "UPSTREAM_IDLE": max(1, keepalive - 1),
        # The app's own worst case (gunicorn's `timeout`, WEB_TIMEOUT) plus room.
        "UPSTREAM_TIMEOUT": int(env.get("WEB_TIMEOUT") or 30) + 30,
        "MAX_BODY_BYTES": body_bytes if body_bytes is not None else max_body_bytes(),
        "BODY_BUFFER_BYTES": BODY_BUFFER_BYTES,
        "ACCESS_LOG": f"{access} combined" if access else "off",
        "ERROR_LOG_LEVEL": get["PROXY_ERROR_LOG_LEVEL"],
    }


def descriptors(connections: int) -> tuple[int, int]:
    """(worker_connections, worker_rlimit_nofile) within the hard descriptor limit: an
    unprivileged nginx cannot raise it, and a worker out of descriptors stops accepting."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = FDS_PER_CONNECTION * connections
    if hard != resource.RLIM_INFINITY:
        nofile = min(nofile, hard)
    return min(connections, nofile // 2), nofile


_NAME = re.compile(r"\$\{([A-Z_]+)\}")


def render(vals: dict, template: str | None = None) -> str:
    """${NAME} replaced by vals[NAME]; nginx's own $variables are lowercase and stay."""
    text = TEMPLATE.read_text() if template is None else template
    missing = sorted({m for m in _NAME.findall(text) if m not in vals})
    if missing:
        raise KeyError(f"no value for {', '.join(missing)}")
    return _NAME.sub(lambda m: str(vals[m.group(1)]), text)


def prepare(vals: dict) -> Path:
    """Write the config and make the directories it names; return the config's path."""
    base = Path(vals["DIR"])
    # nginx makes the temp directories itself, owned by its workers' user.
    base.mkdir(parents=True, exist_ok=True)
    conf = base / "nginx.conf"
    conf.write_text(render(vals))
    return conf


def nginx_argv(conf: Path, *extra: str) -> list[str]:
    """nginx in the foreground, its early errors on stderr (not /var/log/nginx)."""
    binary = shutil.which(BINARY) or f"/usr/sbin/{BINARY}"
    return [binary, "-e", "stderr", "-p", str(conf.parent), "-c", str(conf),
            "-g", "daemon off;", *extra]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jobservice.proxy", description=__doc__)
    parser.add_argument("--check", action="store_true", help="render, then nginx -t")
    parser.add_argument("--print", action="store_true", help="render to stdout")
    args = parser.parse_args(argv)
    vals = values()
    if args.print:
        sys.stdout.write(render(vals))
        return
    conf = prepare(vals)
    if args.check:
        sys.exit(subprocess.run(nginx_argv(conf, "-t")).returncode)
    os.execv(nginx_argv(conf)[0], nginx_argv(conf))


if __name__ == "__main__":
    main()
