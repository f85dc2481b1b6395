"""Summarise py-spy raw (collapsed) stacks: `python -m bench.profile_summary FILE... [--top N]`.

Prints where the samples of busy threads went: self time per function and
inclusive time per function, each as a share of all non-idle samples.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

# Frames that mean "waiting", not working: a thread parked here is idle.
IDLE = re.compile(r"^(wait|_wait_for_tstate_lock|select|poll|recv_into|_recv|get) \(")


def frame_name(frame: str) -> str:
    # py-spy raw frames look like "func (path/to/file.py:123)"; keep func and file:line-less.
    m = re.match(r"(.*?) \((.*?)(?::\d+)?\)$", frame)
    if not m:
        return frame
    func, path = m.groups()
    short = "/".join(path.split("/")[-2:])
    return f"{func} ({short})"


def summarise(files: list[Path], top: int) -> str:
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = idle = 0
    for f in files:
        for line in f.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = [x for x in stack.split(";") if not x.startswith(("thread ", "process "))]
            if not frames:
                continue
            leaf = frames[-1]
            if IDLE.match(leaf):
                idle += n
                continue
            total += n
            self_time[frame_name(leaf)] += n
            for name in {frame_name(x) for x in frames}:
                inclusive[name] += n
    out = [f"{total} busy samples ({idle} idle samples left out)", "", "self time:"]
    out += [f"  {c / total:6.1%}  {name}" for name, c in self_time.most_common(top)]
    out += ["", "inclusive time:"]
    out += [f"  {c / total:6.1%}  {name}" for name, c in inclusive.most_common(top)]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.profile_summary")
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    print(summarise(args.files, args.top))


if __name__ == "__main__":
    main()
