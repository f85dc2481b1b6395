"""`python -m bench.durable_replay [--sizes 10,100,1000] [--repeat 5]`.

Replay cost (issue 45): a durable run with N stored steps wakes up; the time from its
handler's first `ctx.step` to the end of its next new step (the stored results read,
N steps replayed and checked against the history's order, one checkpoint written), in
process on a scratch database. Beside it, the same replay reading each stored result
with a query of its own (what a per-step read would cost). It reports; it never
asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _job_with_steps(n: int):
    from jobs import services

    job, _ = services.submit("echo", {})
    lease = services.claim("bench-replay", job.pk)
    for i in range(n):
        assert services.checkpoint_step(lease, f"s{i}", json.dumps({"i": i, "pad": "x" * 40}))
    services.release([lease])
    return services.claim("bench-replay", job.pk)


def _replay(lease, n: int, per_step: bool) -> float:
    from jobs import durable, replica

    ctx = durable.context(lease)
    if per_step:  # the per-step variant: one SELECT per stored result, no bulk read
        ctx._steps, ctx._order, ctx._loaded_at = {}, [], None
        started = time.perf_counter()
        for i in range(n):
            _, value = replica.fetch(
                "SELECT true, result FROM jobs_jobstep WHERE job_id = %s AND name = %s",
                [lease.job_id, f"s{i}"],
            )[0]
            ctx._steps[f"s{i}"] = value
    else:
        started = time.perf_counter()
        for i in range(n):
            ctx.step(f"s{i}", lambda: None)
    ctx.step("next", lambda: 1)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.durable_replay", description=__doc__)
    p.add_argument("--sizes", default="10,100,1000")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    from bench.env import scratch_django

    with scratch_django():
        from django.conf import settings

        settings.JOBS_MAX_STEPS = 10_000  # the next step after 1,000 stored ones
        for n in (int(x) for x in args.sizes.split(",")):
            for label, per_step in (("one query", False), ("a query per step", True)):
                times = [_replay(_job_with_steps(n), n, per_step) for _ in range(args.repeat)]
                print(f"{n:5d} stored steps, {label:16s}: wake-up -> next new step "
                      f"{statistics.median(times) * 1000:8.2f} ms (median of {args.repeat})",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
