"""The alert rules: promtool validates and unit-tests them, and every metric and label they
name is one the processes really export (a typo would be an alert that never fires)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import REGISTRY
from prometheus_client.utils import floatToGoString

from jobs import metrics
from jobs.collectors import (
    ConsumersCollector,
    DepthCollector,
    DurableHistoryCollector,
    PartitionCollector,
    QueueControlsCollector,
    WebhookCircuitsCollector,
    reaper_gauges,
    scheduler_gauges,
    worker_gauges,
)
from jobs.events.lag import OutboxLagCollector
from tests.harness import ROOT

PROM_DIR = ROOT / "deploy" / "prometheus"
ALERTS = PROM_DIR / "alerts.yml"
SEVERITIES = {"critical", "warning"}
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"job", "instance"}
DURATION = re.compile(r"^(\d+[smhd])+$")


def promtool(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing: `make test` installs it (Debian package prometheus)")
        pytest.skip("promtool is not installed (make test installs it: apt-get install prometheus)")
    return subprocess.run([exe, *args], cwd=PROM_DIR, capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_rules():
    out = promtool("check", "rules", "alerts.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_accepts_the_scrape_config():
    out = promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_unit_tests_of_the_alerts_pass():
    out = promtool("test", "rules", "alerts_test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_catches_a_broken_rule(tmp_path: Path):
    """The checks above can fail: a rule with bad PromQL is refused."""
    bad = tmp_path / "bad.yml"
    bad.write_text(
        "groups:\n- name: x\n  rules:\n  - alert: Broken\n"
        "    expr: sum(rate(jobs_submitted_total[5m]) > \n    for: 1m\n"
    )
    out = promtool("check", "rules", str(bad))
    assert out.returncode != 0


# --- what the rules reference exists ---------------------------------------------------


def exported() -> dict[str, set[str]]:
    """Every series name the processes can export → its label names."""
    from django_prometheus.middleware import Metrics

    Metrics.get_instance()  # the API's request metrics, registered when the app serves
    names: dict[str, set[str]] = {}
    for name, collector in REGISTRY._names_to_collectors.items():
        labels = set(getattr(collector, "_labelnames", ()))
        if name.endswith("_bucket"):
            labels.add("le")
        names[name] = labels
    worker = SimpleNamespace(inflight=0, running=0, concurrency=1)
    reaper = SimpleNamespace(last_sweep_at=0.0, interval=5.0)
    scheduler = SimpleNamespace(last_tick_at=0.0, overdue=0.0)
    gauges = (worker_gauges(worker), reaper_gauges(reaper), scheduler_gauges(scheduler))
    for collector in gauges:
        for family in collector.collect():
            names[family.name] = set()
    for family in DepthCollector(cache_seconds=5).describe():
        names[family.name] = {"state", "queue"}
    for family in ConsumersCollector(DepthCollector(cache_seconds=5)).describe():
        names[family.name] = {"queue"}
    for family in QueueControlsCollector(cache_seconds=5).describe():
        names[family.name] = {"queue"}
    for family in WebhookCircuitsCollector(cache_seconds=5).describe():
        names[family.name] = {"state"}
    for family in PartitionCollector(cache_seconds=5).describe():
        names[family.name] = set()
    for family in DurableHistoryCollector(cache_seconds=5).describe():
        names[family.name] = set()
    for family in OutboxLagCollector().describe():
        names[family.name] = {"subscriber"}
    return names


def rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


SELECTOR = re.compile(r"\b((?:jobs|django)[a-zA-Z0-9_:]*)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(?:=~|!=|!~|=)\s*"([^"]*)"')
BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def test_every_metric_and_label_in_the_rules_is_exported():
    names = exported()
    records = {r["record"] for r in rules() if "record" in r}
    slo_bounds = {floatToGoString(b) for b in metrics.TIME_TO_TERMINAL._upper_bounds}
    for rule in rules():
        expr = rule["expr"]
        used: set[str] = set()
        for name, selector in SELECTOR.findall(expr):
            if ":" in name:
                assert name in records, f"{name} is not a recording rule here"
                continue
            assert name in names, f"{rule.get('alert') or rule['record']}: {name} not exported"
            used |= names[name]
            for label, value in MATCHER.findall(selector or ""):
                assert label in names[name] | TARGET_LABELS, f"{name} has no label {label}"
                if label == "le":
                    assert value in slo_bounds, f"no bucket le={value!r}"
        for group in BY.findall(expr):
            for label in (x.strip() for x in group.split(",") if x.strip()):
                assert label in used | TARGET_LABELS | {"le"}, f"{expr}: by {label}?"


def test_every_alert_has_a_delay_severity_and_runbook():
    alerts = [r for r in rules() if "alert" in r]
    assert len({a["alert"] for a in alerts}) == len(alerts)
    for a in alerts:
        assert DURATION.match(str(a.get("for", ""))), f"{a['alert']} needs a `for:`"
        assert a["labels"]["severity"] in SEVERITIES, a["alert"]
        for key in ("summary", "description", "runbook"):
            assert a["annotations"].get(key, "").strip(), f"{a['alert']} has no {key}"


def test_the_slo_rules_cover_the_brief():
    """SLO burn (p95 and budget), enqueue_failed, lease expiries, fences, queue age,
    worker and reaper absence, stalled sweeps and Redis errors each have an alert."""
    exprs = {r["alert"]: r["expr"] for r in rules() if "alert" in r}
    wanted = {
        "histogram_quantile(0.95": "jobs_time_to_terminal_seconds_bucket",
        "jobs:time_to_terminal_slow_ratio": "",
        "jobs_enqueue_failed_total": "",
        "jobs_lease_expired_total": "",
        "jobs_fence_rejections_total": "",
        'jobs_oldest_age_seconds{state="queued"}': "",
        'absent(up{job="worker"}': "",
        'absent(up{job="reaper"}': "",
        "jobs_reaper_last_sweep_timestamp_seconds": "",
        "jobs_redis_errors_total": "",
    }
    for needle, also in wanted.items():
        assert any(needle in e and also in e for e in exprs.values()), needle


def test_the_operations_guide_documents_every_metric_and_alert():
    guide = (ROOT / "docs" / "operations.md").read_text()
    section = guide.split("\n## Metrics and alerts\n", 1)[1].split("\n## ", 1)[0]
    families = {n.removesuffix("_total") for n in exported() if n.startswith("jobs_")}
    families = {re.sub(r"_(bucket|count|sum|created)$", "", n) for n in families}
    missing = sorted(n for n in families if n not in section)
    assert not missing, f"docs/operations.md does not describe {missing}"
    alerts = [r["alert"] for r in rules() if "alert" in r]
    assert not [a for a in alerts if a not in section]
