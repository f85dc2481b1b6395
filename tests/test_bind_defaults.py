"""Safe listening defaults, checked with real processes and real sockets: outside a
container everything listens on 127.0.0.1 unless told; the image and docker-compose
say 0.0.0.0 so the published port and Prometheus reach the processes."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.harness import Stack, database_url, free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent


def outside_address() -> str:
    """An IPv4 address of this machine other than loopback (e.g. eth0's)."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for addr in out.split():
        if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", addr) and not addr.startswith("127."):
            return addr
    pytest.skip("this machine has no non-loopback IPv4 address to connect from")


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def get(url: str, host_header: str = "localhost") -> int:
    req = urllib.request.Request(url, headers={"Host": host_header})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def compose_env(service: str) -> dict[str, str]:
    """A service's environment from docker-compose.yml, each ${VAR:-default} at its default."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    env = {}
    for key, value in services[service]["environment"].items():
        env[key] = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))
    return env


def dockerfile_env() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for pair in shlex.split(line[4:]):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def image_command() -> list[str]:
    (line,) = [x for x in (ROOT / "Dockerfile").read_text().splitlines() if x.startswith("CMD ")]
    return yaml.safe_load(line[4:])


@pytest.mark.slow
@pytest.mark.django_db
def test_the_images_api_command_is_reachable_from_outside_loopback(tmp_path):
    """python -m jobservice.serve (the image's CMD) with the image's and compose's
    environment: the published port and Prometheus' api:8000 connect from outside the
    container's loopback. gunicorn.conf.py's own default stays 127.0.0.1."""
    address = outside_address()
    env = {**dockerfile_env(), **compose_env("api")}
    assert "BIND" in env, "neither the Dockerfile nor compose sets BIND: the API binds 127.0.0.1"
    host, _, port = env["BIND"].rpartition(":")
    assert (host, port) == ("0.0.0.0", "8000"), env["BIND"]
    port = str(free_port())  # the same host, on a port free on this shared machine
    run_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "JOBS_"))},
        **env,
        "BIND": f"{host}:{port}",
        "WEB_CONCURRENCY": "1",
        "SECRET_KEY": "k" * 64 + "-bind-test-not-a-real-secret",
        "DATABASE_URL": database_url(),
        "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        "STATIC_ROOT": str(tmp_path),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    cmd = image_command()
    assert cmd == ["python", "-m", "jobservice.serve"], cmd
    log = open(tmp_path / "api.log", "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=run_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(
            lambda: reachable("127.0.0.1", int(port)) or proc.poll() is not None, 30,
            "the API server to listen", interval=0.2,
        )  # fmt: skip
        assert proc.poll() is None, (tmp_path / "api.log").read_text()
        assert reachable(address, int(port)), f"nothing answers on {address}:{port}"
        assert get(f"http://{address}:{port}/healthz") == 200
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def test_gunicorn_conf_defaults_to_loopback():
    text = (ROOT / "gunicorn.conf.py").read_text()
    assert 'os.environ.get("BIND", "127.0.0.1:8000")' in text


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("command", ["runworker", "runreaper"])
def test_metrics_listen_on_loopback_unless_told(tmp_path, command):
    """`--metrics-port` alone serves 127.0.0.1 only; compose's JOBS_METRICS_HOST=0.0.0.0
    (and --metrics-host) open it to other machines."""
    address = outside_address()
    assert compose_env("worker")["JOBS_METRICS_HOST"] == "0.0.0.0"
    assert compose_env("reaper")["JOBS_METRICS_HOST"] == "0.0.0.0"
    stack = Stack(tmp_path)
    try:
        local, opened, flag = free_port(), free_port(), free_port()
        stack.start(command, "--metrics-port", str(local))
        stack.start(command, "--metrics-port", str(opened), JOBS_METRICS_HOST="0.0.0.0")
        stack.start(command, "--metrics-port", str(flag), "--metrics-host", address)
        for port in (local, opened, flag):
            wait_until(
                lambda p=port: reachable("127.0.0.1", p) or reachable(address, p), 30,
                f"{command} metrics on {port}\n{stack.logs()}", interval=0.2,
            )  # fmt: skip
        assert reachable("127.0.0.1", local)
        assert not reachable(address, local), "metrics open to other machines by default"
        assert get(f"http://{address}:{opened}/metrics") == 200
        assert get(f"http://{address}:{flag}/metrics") == 200
        assert not reachable("127.0.0.1", flag)  # bound to that address only
    finally:
        stack.close()
