"""The check commands of docs/operations.md "Past one Postgres", run as written.

Each check is a ```sh block right after a `<!-- check: NAME -->` line; the tests that
stand up the topology (a real PgBouncer, a real replica) run them with the deployment's
variables and assert what the runbook says they print.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from harness import ROOT

RUNBOOK = ROOT / "docs" / "operations.md"
_CHECK = re.compile(r"<!-- check: ([\w-]+) -->\n```sh\n(.*?)\n```", re.S)


def checks() -> dict[str, str]:
    text = RUNBOOK.read_text()
    section = text[text.index("## Past one Postgres") :]
    return dict(_CHECK.findall(section))


def run_check(name: str, env: dict[str, str]) -> str:
    """The check's output (stripped); fails the test with its output when it fails."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', os.environ['PATH'])}"
    out = subprocess.run(["bash", "-eo", "pipefail", "-c", checks()[name]], cwd=ROOT,
                         env={**env, "PATH": path}, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, f"check {name} failed:\n{out.stdout}{out.stderr}"
    return out.stdout.strip()
