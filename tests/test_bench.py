"""`python -m bench --quick` runs end to end and writes well-formed JSON lines.

It checks the shape of the report, never a timing: figures depend on the machine.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

# The modules that register scenarios when imported, as bench/__main__.py imports them.
from bench import fillfactor, scaling, scenarios, table_growth, webhooks  # noqa: F401
from jobs.worker.pools import DEFAULT_CONCURRENCY
from tests.harness import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.long]


def test_quick_bench_reports_a_figure_per_scenario(tmp_path):
    out = tmp_path / "bench.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    expected = set(scenarios.default_names(quick=True))
    seen = {r["scenario"] for r in records}
    assert seen == expected, proc.stdout
    for r in records:
        assert r["command"].startswith("python -m bench --scenario ")
        assert r["unit"] and r["figure"] and r["run"] and r["git"]
        if r["value"] is None:  # only a scenario that says why it was not measured
            assert r["note"].startswith("NOT MEASURED"), r
        else:
            assert isinstance(r["value"], float) and math.isfinite(r["value"]) and r["value"] > 0
        assert r["command"] in proc.stdout
        # A submission the bench makes is never refused: a 429 (the per-client share
        # of a queue, D198, once capped http-bulk at 10 requests) is not a figure.
        if r["scenario"] in ("http-single", "http-bulk"):
            assert set(r["details"]["statuses"]) == {"201"}, r["summary"]
    # The scratch database is gone afterwards.
    run = records[0]["run"]
    assert "jobservice_bench_" in proc.stdout and run in proc.stdout
    db = proc.stdout.split("database ", 1)[1].split(",", 1)[0]
    listed = subprocess.run(
        [
            "psql",
            "-h",
            "127.0.0.1",
            "-U",
            "root",
            "-d",
            "postgres",
            "-Atc",
            f"SELECT count(*) FROM pg_database WHERE datname = '{db}'",
        ],
        capture_output=True,
        text=True,
    )
    assert listed.stdout.strip() == "0"


def test_drain_sinks_can_hold_the_deliveries_until_every_cursor_has_passed(tmp_path):
    """--deliveries-after-sinks: the relays' lag without the deliveries' work beside them,
    and every delivery still made, by a webhooks worker started afterwards."""
    out = tmp_path / "bench.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    args = ["--quick", "--scenario", "drain-sinks", "--deliveries-after-sinks"]
    proc = subprocess.run([sys.executable, "-m", "bench", *args, "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=280)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["code"].endswith("(deliveries after the sinks)")
    assert "--deliveries-after-sinks" in record["command"]
    assert isinstance(record["value"], float) and record["value"] > 0
    passed = record["summary"].split("last event passed by ", 1)[1]
    assert "receiver" in passed and "webhooks" in passed, record["summary"]


def test_request_cpu_reports_each_trees_cpu_per_submission():
    """`python -m bench.request_cpu --baseline REF`: one line per tree with a positive
    median, and the command (the submissions are answered 201, or the child stops)."""
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.request_cpu", "--baseline", "HEAD",
         "--rounds", "2", "--requests", "20"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "CPU per submission" in line]
    assert [line.split(":")[0].split("@")[0] for line in lines] == ["current", "HEAD"]
    for line in lines:
        assert float(line.split("CPU per submission ")[1].split(" ms")[0]) > 0
    assert "$ python -m bench.request_cpu --baseline HEAD" in proc.stdout


def durable_steps_report(*args: str) -> dict:
    """`python -m bench.durable_steps ARGS` run to its end: its last JSON line."""
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.durable_steps", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])


def test_durable_steps_times_dbos_as_ours_with_every_workflow_enqueued_first():
    """D386: DBOS's span is first start -> last finish on the database clock, and no
    workflow starts before the last is enqueued (as ours are submitted first)."""
    pytest.importorskip("dbos")
    report = durable_steps_report("--jobs", "20", "--steps", "2", "--only", "dbos")
    assert report["done"] == 20 and report["enqueued_first"] is True
    assert 0 < report["span"] < 300


def test_durable_steps_reports_what_the_checkpointing_connections_wait_for():
    """The split that says why a default worker's steps/s stop where they do: the
    average number of checkpointing connections in each state, sampled."""
    report = durable_steps_report("--jobs", "300", "--steps", "5", "--only", "jobservice")
    assert report["done"] == 300
    waits = report["step_waits"]
    # A default worker's handler threads (D395): at most that many checkpointing
    # connections, and some seen.
    assert 0 < sum(waits.values()) <= DEFAULT_CONCURRENCY["threads"] + 1e-9
    assert all(isinstance(k, str) and k for k in waits), waits
