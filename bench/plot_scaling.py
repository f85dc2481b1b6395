"""Plot the scaling curve from a bench run's JSON lines (`--scenario scale`).

    python -m bench.plot_scaling bench/results/<run>.jsonl docs/scaling.png

Left: drain jobs/s (solid) and claim statement p99 (dashed, right axis) against worker
processes; right: HTTP submissions/s against gunicorn workers. One line per route
(straight to PostgreSQL, through PgBouncer). matplotlib comes with `make bench`
(the `bench` extra), not with the app.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("scenario") == "scale" and r.get("value")]


def series(records: list[dict], kind: str, route: str, key: str = "value") -> tuple[list, list]:
    points = sorted(
        (r["details"]["processes"], r["value"] if key == "value" else r["details"]["claim_ms"][key])
        for r in records
        if r["details"]["kind"] == kind and r["details"]["route"] == route
    )
    return [p[0] for p in points], [p[1] for p in points]


def plot(records: list[dict], out: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    p99_axis = left.twinx()
    colours = {"direct": "tab:blue", "pgbouncer": "tab:orange"}
    for route, colour in colours.items():
        x, y = series(records, "workers", route)
        if x:
            left.plot(x, y, "o-", color=colour, label=f"jobs/s, {route}")
            px, py = series(records, "workers", route, "p99")
            p99_axis.plot(px, py, "s--", color=colour, alpha=0.6, label=f"claim p99, {route}")
        x, y = series(records, "api", route)
        if x:
            right.plot(x, y, "o-", color=colour, label=route)
    left.set_xlabel("runworker processes")
    left.set_ylabel("jobs/s (drain)")
    p99_axis.set_ylabel("claim statement p99 (ms)")
    left.set_xscale("log", base=2)
    left.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    lines = left.get_legend_handles_labels()
    more = p99_axis.get_legend_handles_labels()
    left.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
    right.set_xlabel("gunicorn workers")
    right.set_ylabel("jobs/s (single POSTs)")
    right.set_xticks([1, 2, 4], ["1", "2", "4"])
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    p99_axis.set_ylim(bottom=0)
    fig.suptitle(title or "jobservice on one PostgreSQL: throughput against processes")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    source, out = Path(argv[0]), Path(argv[1])
    records = load(source)
    if not records:
        print(f"no scale records in {source}", file=sys.stderr)
        return 1
    meta = records[0]
    plot(records, out, f"jobservice scaling, {meta.get('cpus')} CPUs, run {meta.get('run')}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
