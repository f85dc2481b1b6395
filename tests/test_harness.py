"""The shared harness (`harness/`) and the layout of the dev packages around it.

The tests, the fault suite and the bench all start their processes, Redis servers and
scratch databases through `harness`; these check what they rely on, for real.
"""

from __future__ import annotations

import ast
import graphlib
import os
import subprocess
import sys
import time

import psycopg
import pytest

from harness import (
    ROOT,
    RedisServer,
    ScratchDatabase,
    Service,
    WaitTimeout,
    free_port,
    http_ok,
    wait_until,
)

DEV_PACKAGES = ("bench", "chaos", "harness")
PROJECT = {"bench", "chaos", "demo", "harness", "jobs", "jobservice", "tests"}


def modules(package: str) -> dict[str, ast.Module]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def imported(tree: ast.Module) -> set[str]:
    """Every module named by an import anywhere in the file, inside functions too."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


# --- layout ---------------------------------------------------------------------------


@pytest.mark.parametrize("package", [*DEV_PACKAGES, "tests"])
def test_no_module_shadows_the_standard_library(package):
    """`python bench/x.py` puts bench/ first on sys.path: bench/http.py then hid `http`."""
    clashes = [
        str(path.relative_to(ROOT))
        for path in (ROOT / package).iterdir()
        if (path.suffix == ".py" or (path / "__init__.py").exists())
        and path.stem in sys.stdlib_module_names
    ]
    assert clashes == []


def test_bench_chaos_and_harness_never_import_the_tests():
    offenders = {
        name: sorted(m for m in imported(tree) if m.split(".")[0] == "tests")
        for package in DEV_PACKAGES
        for name, tree in modules(package).items()
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_harness_imports_nothing_of_the_project_but_itself():
    """It serves the tests, the fault suite and the bench; it may not lean on any of them."""
    offenders = {
        name: sorted(m for m in imported(tree) if m.split(".")[0] in PROJECT - {"harness"})
        for name, tree in modules("harness").items()
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_import_cycle_in_the_dev_packages():
    """Imports inside functions count: they hid the bench/http.py <-> scenarios cycle."""
    graph: dict[str, set[str]] = {}
    for package in DEV_PACKAGES:
        found = modules(package)
        for name, tree in found.items():
            graph[name] = {m for m in imported(tree) if m in found and m != name}
    for name in graph:  # a package's __init__ is not an edge back to its own modules
        graph[name].discard(name.rsplit(".", 1)[0])
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError on a cycle


# --- waiting ----------------------------------------------------------------------------


def test_a_wait_that_runs_out_is_a_test_failure_and_a_timeout():
    started = time.monotonic()
    with pytest.raises(WaitTimeout, match="waiting for the moon") as caught:
        wait_until(lambda: False, 0.2, "the moon", interval=0.05)
    assert 0.2 <= time.monotonic() - started < 5
    assert isinstance(caught.value, AssertionError) and isinstance(caught.value, TimeoutError)
    with pytest.raises(AssertionError, match="waiting for the sun"):
        wait_until(lambda: 0, 0.1, message="the sun")
    assert wait_until(lambda: "value", 1) == "value"


# --- services -----------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie waiting for init to reap it is gone too.
    return "State:\tZ" in open(f"/proc/{pid}/status").read()


def test_stop_escalates_to_sigkill_and_takes_the_whole_group(tmp_path):
    """A process that ignores SIGTERM and has a child (like gunicorn's master) is gone."""
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    svc = Service("stubborn", [sys.executable, "-c", script], dict(os.environ), tmp_path / "s.log")
    svc.start()
    child = int(wait_until(lambda: svc.output().strip(), 10, "the child's pid"))
    assert svc.children() == [child]
    started = time.monotonic()
    assert svc.stop(grace=0.5) == -9
    assert time.monotonic() - started < 10
    wait_until(lambda: _gone(child), 5, "the child to be killed with its parent")
    assert not svc.alive()


def test_a_restart_appends_to_the_log_after_a_banner_and_a_first_start_truncates(tmp_path):
    log = tmp_path / "w.log"
    log.write_text("left over from an earlier run\n")
    svc = Service("w", [sys.executable, "-c", "print('hello')"], dict(os.environ), log)
    svc.start().wait(10)
    assert svc.output() == "hello\n"
    svc.start().wait(10)
    lines = svc.output().splitlines()
    assert lines[:2] == ["hello", ""] and lines[3:] == ["hello"]
    assert lines[2].startswith("=== start #2 at ")
    assert svc.starts == 2


def test_kill_is_kill_9_and_says_whether_anything_was_running(tmp_path):
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    svc = Service("w", argv, dict(os.environ), tmp_path / "w.log")
    svc.start()
    assert svc.kill() is True
    assert svc.proc.returncode == -9
    assert svc.kill() is False


def test_http_ok_is_false_until_something_answers_200(tmp_path):
    port = free_port()
    assert http_ok(port) is False
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    server = Service("http", argv, dict(os.environ), tmp_path / "h.log", cwd=tmp_path)
    (tmp_path / "healthz").write_text("ok")
    server.start()
    try:
        wait_until(lambda: http_ok(port), 15, "http.server")
        assert http_ok(port, "/missing") is False  # a 404 is not healthy
    finally:
        server.stop(grace=5)


# --- redis ----------------------------------------------------------------------------------


def test_a_private_redis_restart_comes_back_empty():
    server = RedisServer().start()
    try:
        client = server.client()
        client.set("k", "v")
        assert server.cli("GET", "k") == "v"
        server.stop()
        assert server.ping() is False
        server.start()
        assert server.client().get("k") is None
    finally:
        server.stop()


# --- scratch databases ------------------------------------------------------------------


def test_drop_stale_drops_only_leftovers_whose_run_is_gone():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = ScratchDatabase("harnesstest").create()
    leftover = ScratchDatabase("harnesstest", name=f"{mine.prefix}{dead.pid}").create()
    other = ScratchDatabase("harnessother")
    other_kind = ScratchDatabase("harnessother", name=f"{other.prefix}{dead.pid}").create()
    try:
        assert mine.drop_stale() == [leftover.name]
        with mine.connect() as conn:
            names = {r[0] for r in conn.execute("SELECT datname FROM pg_database")}
        assert mine.name in names and other_kind.name in names and leftover.name not in names
    finally:
        for db in (mine, leftover, other_kind):
            db.drop()
    with pytest.raises(psycopg.OperationalError):
        mine.connect().close()


# --- webhook receivers ----------------------------------------------------------------


def _post_calls(url: str, n: int) -> list[tuple[int, str | None]]:
    """n webhook POSTs on one kept-alive connection: (status, Retry-After) of each."""
    import http.client
    import json
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    answers = []
    try:
        for i in range(n):
            body = json.dumps({"type": "job.done", "data": {"id": i // 3, "seq": i % 3}})
            conn.request("POST", parts.path, body=body, headers={"webhook-id": f"msg_{i}"})
            resp = conn.getresponse()
            resp.read()
            answers.append((resp.status, resp.getheader("Retry-After")))
            assert not resp.will_close
    finally:
        conn.close()
    return answers


def test_the_receiver_process_answers_and_records_as_the_thread_receiver_does():
    """The bench's receiver in a process of its own notes what the thread one notes and
    answers the same seeded 500s, so the two give the same figures' checks."""
    from harness.receiver import Recording
    from harness.receiver_process import ReceiverProcess

    thread, process = Recording(0.3), ReceiverProcess(0.3)
    try:
        answers = _post_calls(thread.url, 60)
        assert _post_calls(process.url, 60) == answers
        assert {a for a in answers} == {(200, None), (500, "1")}
        (t_calls, t_bodies), (p_calls, p_bodies) = thread.snapshot(), process.snapshot()
        assert [c[:3] + c[4:] for c in p_calls] == [c[:3] + c[4:] for c in t_calls]
        assert p_bodies == t_bodies
        ok = {c[0] for c in t_calls if c[4] == 200}
        assert process.count() == thread.count() == len(ok)
        assert process.delivered().keys() == thread.delivered().keys() == ok
    finally:
        thread.close()
        process.close()
    assert process.proc.returncode == 0  # its stdin closing ends it
