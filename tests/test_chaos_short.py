"""`make test` runs the fault suite's short profile (collected last; see conftest)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from chaos.profiles import FAULT_KINDS
from harness import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


@pytest.mark.timeout(300)
def test_short_fault_suite_passes():
    """The real stack under every fault kind: all invariants hold (exit 0).

    The seed is random per run (CHAOS_SEED pins it) and printed with the schedule,
    so a failure seen once in CI can be replayed with `--seed`.
    """
    cmd = [sys.executable, "-m", "chaos", "--profile", "short"]
    if os.environ.get("CHAOS_SEED"):
        cmd += ["--seed", os.environ["CHAOS_SEED"]]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the harness cleans up its stack and database
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"the short profile took over 240s:\n{out[-6000:]}")
    print(out)
    report = out[out.rfind("=== fault suite report") :]
    assert proc.returncode == 0, report or out[-6000:]
    assert "RESULT:   PASS" in report
    faults = re.search(r"^faults:(.*?)^history:", report, re.M | re.S).group(1)
    missing = [k for k in FAULT_KINDS if not re.search(rf"\b{k}\s+[1-9]", faults)]
    assert not missing, f"fault kinds never injected: {missing}"
    assert re.search(r"^  PASS  lost_or_stuck$", report, re.M)
    # Durable steps and workflows ran under the faults, and their invariants held.
    for check in ("steps_under_held_lease", "children_after_parents", "sequences_serial"):
        assert re.search(rf"^  PASS  {check}$", report, re.M), check
    # chaos.die killed process-pool children (issue 27): their attempts ended failed.
    for seen in ("step_checkpoints", "workflows", "parked_sleeps", "child_deaths", "sequence_jobs"):
        assert re.search(rf"\b{seen}\s+[1-9]", report), f"no {seen} in the run"
