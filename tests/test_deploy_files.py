"""The deployment files, checked by parsing them (no Docker engine on CI machines):
docker-compose.yml, the Prometheus config and rules, the Dockerfile."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from harness import free_port

ROOT = Path(__file__).resolve().parent.parent
APP_SERVICES = ("migrate", "api", "proxy", "worker", "reaper")
LONG_RUNNING = ("postgres", "redis", "proxy", "api", "worker", "reaper", "prometheus")
REQUIRED_ENV = ("JOBS_PRODUCTION", "SECRET_KEY", "DATABASE_URL", "REDIS_URL", "ALLOWED_HOSTS")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


@pytest.fixture(scope="module")
def prometheus() -> dict:
    return yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())


def command_of(service: dict) -> list[str]:
    cmd = service.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def option(cmd: list[str], name: str) -> str:
    assert name in cmd, f"{name} missing from {cmd}"
    return cmd[cmd.index(name) + 1]


def interpolated(value: str) -> str:
    """The value as compose would see it with every ${VAR...} set to "value"."""
    return re.sub(r"\$\{\w+[^}]*\}", "value", str(value))


def healthcheck_text(service: dict) -> str:
    test = service["healthcheck"]["test"]
    return " ".join(test) if isinstance(test, list) else test


# --- docker-compose.yml ------------------------------------------------------------------


def test_compose_has_every_service(services):
    assert set(services) >= {*LONG_RUNNING, "migrate"}


def test_database_and_redis_images_and_health_checks(services):
    assert re.fullmatch(r"postgres:1[56](\.\d+)?(-\w+)?", services["postgres"]["image"])
    assert "pg_isready" in healthcheck_text(services["postgres"])
    assert services["redis"]["image"].startswith("redis:")
    assert "redis-cli ping" in healthcheck_text(services["redis"])


def test_every_long_running_service_has_a_health_check(services):
    for name in LONG_RUNNING:
        hc = services[name].get("healthcheck")
        assert hc and hc.get("test"), f"{name} has no health check"
        assert hc["test"][0] in ("CMD", "CMD-SHELL") if isinstance(hc["test"], list) else True
    assert "/healthz" in healthcheck_text(services["api"])
    assert "localhost:8080/healthz" in healthcheck_text(services["proxy"])
    assert ":9101/" in healthcheck_text(services["worker"])
    assert ":9102/" in healthcheck_text(services["reaper"])


def test_migrations_run_once_before_the_app(services):
    migrate = services["migrate"]
    assert command_of(migrate)[-2:] == ["migrate", "--noinput"]
    assert migrate["restart"] == "no"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("api", "worker", "reaper"):
        deps = services[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
        assert deps["postgres"]["condition"] == "service_healthy", name
        assert deps["redis"]["condition"] == "service_healthy", name


def test_app_services_share_one_image_built_from_this_repo(services):
    images = {services[name]["image"] for name in APP_SERVICES}
    assert len(images) == 1
    for name in APP_SERVICES:
        build = services[name]["build"]
        context = build if isinstance(build, str) else build["context"]
        assert (ROOT / context / "Dockerfile").exists()


def test_app_environment(services):
    for name in APP_SERVICES:
        env = services[name]["environment"]
        assert set(REQUIRED_ENV) <= set(env), name
        assert str(env["JOBS_PRODUCTION"]) == "1"
        assert str(env.get("DEBUG", "0")) == "0"
        # Secrets come from the operator's .env, never from this file.
        assert env["SECRET_KEY"].startswith("${SECRET_KEY:?"), env["SECRET_KEY"]
        db = urlsplit(interpolated(env["DATABASE_URL"]))
        assert db.scheme in ("postgres", "postgresql")
        assert "${POSTGRES_PASSWORD" in env["DATABASE_URL"]
        if name != "migrate":  # migrations always go straight to PostgreSQL
            assert "@${JOBS_DATABASE_ADDRESS:-postgres:5432}/" in env["DATABASE_URL"], name
        assert urlsplit(interpolated(env["JOBS_DIRECT_DATABASE_URL"])).hostname == "postgres"
        assert urlsplit(interpolated(env["REDIS_URL"])).hostname == "redis"
        # The health check asks for localhost, Prometheus for api: both must be allowed.
        hosts = re.sub(r"\$\{[^}]*\}", "", env["ALLOWED_HOSTS"]).split(",")
        assert {"localhost", "api"} <= set(hosts)


def test_pgbouncer_profile_pools_everything_but_presence_and_migrations(services):
    """The profile's pooler is transaction mode, recent enough for prepared statements,
    and in front of the same server the direct address names."""
    bouncer = services["pgbouncer"]
    assert bouncer["profiles"] == ["pgbouncer"]
    env = bouncer["environment"]
    assert (env["POOL_MODE"], env["DB_HOST"], str(env["LISTEN_PORT"])) == (
        "transaction",
        "postgres",
        "6432",
    )
    version = re.search(r":v?(\d+)\.(\d+)", bouncer["image"])
    assert (int(version[1]), int(version[2])) >= (1, 21), bouncer["image"]
    assert int(env["MAX_PREPARED_STATEMENTS"]) > 0
    migrate = urlsplit(interpolated(services["migrate"]["environment"]["DATABASE_URL"]))
    assert (migrate.hostname, migrate.port) == ("postgres", 5432)
    example = (ROOT / ".env.example").read_text()
    assert "# JOBS_DATABASE_ADDRESS=pgbouncer:6432" in example


def test_clients_reach_the_api_only_through_the_front(services):
    """The published port is the front's (D204): the api is reachable inside the stack only,
    the front runs the same image's `python -m jobservice.proxy` in front of api:8000."""
    api, proxy = services["api"], services["proxy"]
    assert "ports" not in api
    assert command_of(proxy) == ["python", "-m", "jobservice.proxy"]
    env = proxy["environment"]
    assert env["PROXY_UPSTREAM"] == "api:" + api["environment"]["BIND"].rpartition(":")[2]
    listen = env["PROXY_LISTEN"].rpartition(":")[2]
    assert [p.rpartition(":")[2] for p in proxy["ports"]] == [listen]
    assert proxy["ports"][0].startswith("${API_PORT:-8000}:")
    assert proxy["depends_on"] == {"api": {"condition": "service_healthy"}}
    # HAProxy's graceful stop: finish what is in flight, exit 0.
    assert proxy["stop_signal"] == "SIGUSR1"
    for name in ("PROXY_REQUEST_TIMEOUT", "PROXY_KEEPALIVE"):
        assert env[name].startswith(f"${{{name}:-"), name


def test_the_front_renders_a_config_haproxy_accepts(tmp_path):
    """The template renders with the launcher's defaults into a config that `haproxy -c`
    accepts, run as this user; one buffer holds the largest body any path accepts, so
    the whole-request deadline covers every body the front forwards (D250)."""
    from jobs.api.parsers import BATCH_BODY_FACTOR, max_body_bytes
    from jobservice import proxy

    listen = f"127.0.0.1:{free_port()}"
    vals = proxy.values({"PROXY_DIR": str(tmp_path / "run"), "PROXY_LISTEN": listen})
    text = proxy.render(vals)
    assert not re.search(r"\$\{[A-Z_]+\}", text)
    bound = BATCH_BODY_FACTOR * max_body_bytes()
    assert f"req.hdr_val(content-length) gt {bound} " in text
    assert int(re.search(r"tune.bufsize (\d+)", text)[1]) > bound + proxy.MAX_HEADER_BYTES
    for line in ("option http-buffer-request", "timeout http-request 10s",
                 "timeout http-keep-alive 10s", "http-error status 408 ",
                 "http-request set-header X-Forwarded-Proto %[var(txn.proto)]"):  # fmt: skip
        assert line in text, line
    if shutil.which("haproxy") is None and not Path("/usr/sbin/haproxy").exists():
        pytest.skip("haproxy is not installed (make tools installs the Debian package haproxy)")
    conf = proxy.prepare(vals)
    assert conf.parent == tmp_path / "run"
    run = subprocess.run(proxy.haproxy_argv(conf, "-c"), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_worker_scales_without_collisions(services):
    worker = services["worker"]
    assert "container_name" not in worker
    assert "ports" not in worker
    cmd = command_of(worker)
    assert cmd[:3] == ["python", "manage.py", "runworker"]
    assert option(cmd, "--metrics-port") == "9101"


def test_two_reapers(services):
    reaper = services["reaper"]
    assert reaper["deploy"]["replicas"] == 2
    assert "container_name" not in reaper and "ports" not in reaper
    cmd = command_of(reaper)
    assert cmd[:3] == ["python", "manage.py", "runreaper"]
    assert option(cmd, "--metrics-port") == "9102"


def test_reapers_relay_to_kafka_when_configured_and_the_topic_is_created_apart(services):
    env = services["reaper"]["environment"]
    for name in ("JOBS_KAFKA_BOOTSTRAP_SERVERS", "JOBS_KAFKA_TOPIC", "JOBS_KAFKA_CONFIG"):
        assert env[name].startswith(f"${{{name}:-"), name  # from the operator's .env
    topic = services["kafka-topic"]
    assert command_of(topic)[:4] == ["python", "manage.py", "kafka", "create-topic"]
    assert topic["restart"] == "no" and topic["profiles"] == ["kafka"]
    assert topic["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_no_fixed_container_names(services):
    assert [n for n, s in services.items() if "container_name" in s] == []


def test_required_variables_are_documented(compose):
    text = (ROOT / "docker-compose.yml").read_text()
    required = set(re.findall(r"\$\{(\w+):\?", text))
    assert required == {"SECRET_KEY", "POSTGRES_PASSWORD"}
    example = (ROOT / ".env.example").read_text()
    documented = set(re.findall(r"^(\w+)=", example, re.M))
    assert required <= documented
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def test_prometheus_mounts_this_config(services):
    mounts = services["prometheus"]["volumes"]
    source = next(m.split(":")[0] for m in mounts if ":/etc/prometheus" in m)
    assert (ROOT / source / "prometheus.yml").exists()
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]


# --- Prometheus ---------------------------------------------------------------------------


def scrape(prometheus: dict, job: str) -> dict:
    jobs = {j["job_name"]: j for j in prometheus["scrape_configs"]}
    assert job in jobs, f"no scrape job {job}: {sorted(jobs)}"
    return jobs[job]


def test_prometheus_loads_the_alert_rules(prometheus):
    assert "alerts.yml" in prometheus["rule_files"]
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    assert isinstance(rules["groups"], list)
    for group in rules["groups"]:
        assert group["name"] and isinstance(group["rules"], list)


def test_prometheus_scrapes_api_workers_and_reapers(prometheus, services):
    api = scrape(prometheus, "api")
    assert api.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in api["static_configs"] for t in sc["targets"]]
    assert targets == ["api:8000"]

    for job, port in (("worker", 9101), ("reaper", 9102)):
        sd = scrape(prometheus, job)["dns_sd_configs"]
        names = {n for cfg in sd for n in cfg["names"]}
        assert names & {job, f"tasks.{job}"}, names
        assert {cfg["port"] for cfg in sd} == {port}
        assert all(cfg.get("type", "SRV") == "A" for cfg in sd)
        # The port Prometheus scrapes is the one the service listens on.
        assert option(command_of(services[job]), "--metrics-port") == str(port)

    for job in ("api", "worker", "reaper"):
        assert job in services


# --- Dockerfile -----------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        instr, _, args = full.partition(" ")
        out.append((instr.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a continuation"
    return out


def exec_form(args: str) -> list[str]:
    return json.loads(args) if args.startswith("[") else shlex.split(args)


def test_dockerfile_base_and_user():
    lines = dockerfile()
    froms = [a for i, a in lines if i == "FROM"]
    assert froms and froms[0].split()[0] == "python:3.11-slim"
    users = [a for i, a in lines if i == "USER"]
    assert users, "the image runs as root"
    assert users[-1].split(":")[0] not in ("root", "0")
    # USER comes after every RUN that needs root.
    last_user = max(n for n, (i, _) in enumerate(lines) if i == "USER")
    assert all(i != "RUN" for i, _ in lines[last_user:])


def test_dockerfile_installs_from_pyproject_and_collects_static():
    lines = dockerfile()
    runs = " ".join(a for i, a in lines if i == "RUN")
    assert "pyproject.toml" in runs and re.search(r"pip install [^&]*\.(\s|$)", runs)
    assert "manage.py collectstatic --noinput" in runs
    for i, a in lines:
        if i == "ADD":
            assert not re.search(r"https?://", a), f"ADD of a remote URL: {a}"


def test_dockerfile_runs_the_api_server():
    lines = dockerfile()
    cmd = [a for i, a in lines if i in ("CMD", "ENTRYPOINT")]
    assert cmd, "no CMD/ENTRYPOINT"
    assert exec_form(cmd[-1]) == ["python", "-m", "jobservice.serve"]
    env = " ".join(a for i, a in lines if i == "ENV")
    assert "JOBS_PRODUCTION=1" in env
    assert "8000" in " ".join(a for i, a in lines if i == "EXPOSE")


def test_dockerfile_installs_the_fronts_haproxy_from_debian():
    lines = dockerfile()
    runs = [a for i, a in lines if i == "RUN"]
    install = "apt-get install -y --no-install-recommends haproxy"
    assert any(install in a for a in runs), runs
    assert "8080" in " ".join(a for i, a in lines if i == "EXPOSE")
    assert (ROOT / "deploy/haproxy/haproxy.cfg.template").exists()


def test_dockerignore_keeps_secrets_and_local_state_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".env", ".venv", ".git", "var"} <= set(ignored)
