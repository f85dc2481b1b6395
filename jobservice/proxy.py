"""The API's front: `python -m jobservice.proxy` renders
deploy/haproxy/haproxy.cfg.template from the environment and runs HAProxy in the
foreground, as the user it is started as (D204, D250). `--check` renders and asks
`haproxy -c` instead; `--print` shows the config.

HAProxy holds each request until it is whole and enforces the whole-request read
deadline granian lacks, answering 408 (D250): see docs/operations.md "The front".
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
TEMPLATE = BASE_DIR / "deploy" / "haproxy" / "haproxy.cfg.template"
BINARY = "haproxy"
# The request headers the front passes (granian's own bound is of the same order).
MAX_HEADER_BYTES = 64 * 1024
# Room in a buffer past the body and the headers: HAProxy's rewrite reserve
# (tune.maxrewrite, 1 KiB by default) and its HTX block headers.
BUFFER_SLACK = 64 * 1024
# A client connection's descriptor and its upstream one.
FDS_PER_CONNECTION = 2

# (environment variable, default): every value the template names, in its units.
DEFAULTS = {
    "PROXY_LISTEN": "0.0.0.0:8080",
    "PROXY_UPSTREAM": "127.0.0.1:8000",
    "PROXY_DIR": "/tmp/jobservice-proxy",
    "PROXY_THREADS": "auto",
    "PROXY_MAX_CONNECTIONS": "16384",
    "PROXY_REQUEST_TIMEOUT": "10",
    "PROXY_KEEPALIVE": "10",
    "PROXY_SEND_TIMEOUT": "30",
    "PROXY_ACCESS_LOG": "",
    "PROXY_LOG_LEVEL": "warning",
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
    """The template's values from `env` (PROXY_*, and WEB_TIMEOUT, the app's own worst
    case as granian applies it)."""
    get = {k: env.get(k) or default for k, default in DEFAULTS.items()}
    body = body_bytes if body_bytes is not None else max_body_bytes()
    threads = get["PROXY_THREADS"]
    maxconn = max_connections(int(get["PROXY_MAX_CONNECTIONS"]))
    return {
        "LISTEN": get["PROXY_LISTEN"],
        "UPSTREAM": get["PROXY_UPSTREAM"],
        "DIR": get["PROXY_DIR"],
        "THREADS": os.cpu_count() or 1 if threads == "auto" else int(threads),
        "MAXCONN": maxconn,
        "BACKLOG": min(maxconn, 65535),
        "REQUEST_TIMEOUT": int(get["PROXY_REQUEST_TIMEOUT"]),
        "KEEPALIVE": int(get["PROXY_KEEPALIVE"]),
        "SEND_TIMEOUT": int(get["PROXY_SEND_TIMEOUT"]),
        # Below compose's stop grace period (10 s by default) so that the exit is clean.
        "STOP_TIMEOUT": 8,
        # The app's own worst case (gunicorn's `timeout`, WEB_TIMEOUT) plus room.
        "UPSTREAM_TIMEOUT": int(env.get("WEB_TIMEOUT") or 30) + 30,
        "MAX_BODY_BYTES": body,
        "MAX_HEADER_BYTES": MAX_HEADER_BYTES,
        "BUFSIZE": body + MAX_HEADER_BYTES + BUFFER_SLACK,
        "ACCESS_LOG": (
            "option httplog\n    log stdout format raw local0 info"
            if get["PROXY_ACCESS_LOG"] == "stdout"
            else "no log"
        ),
        "LOG_LEVEL": get["PROXY_LOG_LEVEL"],
    }


def max_connections(wanted: int) -> int:
    """Client connections within the hard descriptor limit, which an unprivileged HAProxy
    cannot raise: each may pair with one to granian, and HAProxy keeps a few of its own."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (hard - 256) // FDS_PER_CONNECTION))


_NAME = re.compile(r"\$\{([A-Z_]+)\}")


def render(vals: dict, template: str | None = None) -> str:
    """${NAME} replaced by vals[NAME]; HAProxy's own %[...] expressions stay."""
    text = TEMPLATE.read_text() if template is None else template
    missing = sorted({m for m in _NAME.findall(text) if m not in vals})
    if missing:
        raise KeyError(f"no value for {', '.join(missing)}")
    return _NAME.sub(lambda m: str(vals[m.group(1)]), text)


def prepare(vals: dict) -> Path:
    """Write the config under its directory; return the config's path."""
    base = Path(vals["DIR"])
    base.mkdir(parents=True, exist_ok=True)
    conf = base / "haproxy.cfg"
    conf.write_text(render(vals))
    return conf


def haproxy_argv(conf: Path, *extra: str) -> list[str]:
    """HAProxy in the foreground (-db), one process; logs on stdout/stderr."""
    binary = shutil.which(BINARY) or f"/usr/sbin/{BINARY}"
    return [binary, "-db", "-f", str(conf), *extra]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jobservice.proxy", description=__doc__)
    parser.add_argument("--check", action="store_true", help="render, then haproxy -c")
    parser.add_argument("--print", action="store_true", help="render to stdout")
    args = parser.parse_args(argv)
    vals = values()
    if args.print:
        sys.stdout.write(render(vals))
        return
    conf = prepare(vals)
    if args.check:
        sys.exit(subprocess.run(haproxy_argv(conf, "-c"), check=False).returncode)
    os.execv(haproxy_argv(conf)[0], haproxy_argv(conf))


if __name__ == "__main__":
    main()
