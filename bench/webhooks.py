"""Webhook deliveries against a real receiver on 127.0.0.1, and the outbox beside a drain.

`webhook-throughput`: n jobs finish while two default runworkers and a runreaper run,
each event is POSTed to one webhook; the receiver answers 200 at once (deliveries/s and
the lag after the last job's end), then 500 to 30 % of the calls with Retry-After 1
(every event delivered, in seq order per job, one webhook-id per event; the time to the
last). `drain-sinks`: a drain with a webhook, the Redis stream and the Kafka sink on, and
how long after the last job's end each sink has the last event.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterator
from functools import partial

from bench.measure import backend_pids, cpu_seconds, sql
from bench.scenarios import Context, counts_by_status, reset, scenario, wait_terminal
from bench.variants import apply_variant, labelled
from harness import wait_until
from harness.receiver import Recording, first_200s
from harness.receiver_process import ReceiverProcess

WEBHOOK_ENV = {"JOBS_WEBHOOK_ALLOW_PRIVATE": "1"}


def _webhook(url: str, events: list[str]) -> int:
    from jobs.events import signing
    from jobs.models import Client, Webhook

    client, _ = Client.objects.get_or_create(
        name="bench-webhooks", defaults={"token_hash": "b" * 64}
    )
    Webhook.objects.filter(client=client).delete()
    Webhook.objects.create(client=client, url=url, events=events,
                           secret_salt=signing.new_salt())  # fmt: skip
    return client.pk


def _submit(client_id: int, n: int) -> list[int]:
    from django.db import transaction

    from jobs import services

    ids: list[int] = []
    with transaction.atomic():
        for start in range(0, n, 1000):
            items = [services.NewJob("echo", {}) for _ in range(min(1000, n - start))]
            ids += [s.job_id for s in services.submit_many(items, client_id=client_id)]
    return ids


def _expected(job_ids: list[int], events: list[str]) -> dict[str, tuple[int, int]]:
    """webhook-id → (job, seq) of every event of these jobs the webhook takes."""
    from jobs.events import signing

    rows = sql("SELECT id, job_id, seq, to_status FROM jobs_jobevent WHERE kind = 'transition' "
               "AND job_id = ANY(%s::bigint[])", [job_ids])  # fmt: skip
    return {signing.message_id(i): (j, s) for i, j, s, to in rows
            if "*" in events or signing.event_type(to) in events}  # fmt: skip


def _receiver(ctx: Context, fail: float = 0.0) -> Recording | ReceiverProcess:
    """A process of its own (its CPU off the bench's interpreter), or the old thread."""
    return Recording(fail) if ctx.args.receiver_in_bench else ReceiverProcess(fail)


def _all_delivered(receiver: Recording | ReceiverProcess, expected) -> dict[str, float] | None:
    """webhook-id → time of its first 200 once every expected id has one, else None: the
    count first, the whole record only then."""
    if receiver.count() < len(expected):
        return None
    delivered = receiver.delivered()
    return None if expected - delivered.keys() else delivered


def _run(ctx: Context, code, n: int, fail: float, events: list[str]) -> dict:
    reset(ctx)
    sql("DELETE FROM jobs_webhookdelivery")
    receiver = _receiver(ctx, fail)
    try:
        client_id = _webhook(receiver.url, events)
        reaper = ctx.procs.start("runreaper", root=code.root, **WEBHOOK_ENV)
        workers = [ctx.procs.worker(root=code.root, ready=True, **WEBHOOK_ENV) for _ in range(2)]
        pids = [p.pid for p in workers], [reaper.pid]
        cpu_before = cpu_seconds(pids[0]), cpu_seconds(pids[1]), cpu_seconds(backend_pids())
        started = time.time()
        job_ids = _submit(client_id, n)
        wait_terminal(n, timeout=max(120, n / 50), job_ids=job_ids)
        expected = _expected(job_ids, events)
        # A failing receiver's deliveries wait out its circuit (open 10 s and more after
        # five failures in a row), not the machine: 10,000 of its events take minutes.
        deadline = max(300.0, len(expected) / (8 if fail else 20))
        wait_until(lambda: _all_delivered(receiver, expected.keys()) is not None, deadline,
                   f"{len(expected)} events delivered", interval=0.2)  # fmt: skip
        cpu = (cpu_seconds(pids[0]) - cpu_before[0], cpu_seconds(pids[1]) - cpu_before[1],
               cpu_seconds(backend_pids()) - cpu_before[2])  # fmt: skip
        per = [f"{name} {c / len(expected) * 1e6:.0f} us"
               for name, c in zip(("workers", "reaper", "postgres"), cpu, strict=True)]  # fmt: skip
        cpu_note = "CPU per event (jobs and deliveries): " + ", ".join(per)
        for p in [*workers, reaper]:
            p.stop()
        last_job = sql("SELECT extract(epoch FROM max(finished_at)) FROM jobs_job "
                       "WHERE id = ANY(%s::bigint[])", [job_ids])[0][0]  # fmt: skip
        calls, bodies = receiver.snapshot()  # the record, read once
        delivered = first_200s(calls)
        ids_ok = all(len(b) == 1 for b in bodies.values())
        # In order per job: each job's 200s arrive in seq order (a retry repeats only
        # the delivery it retries, never one after it).
        seqs: dict[int, list[int]] = defaultdict(list)
        for _, job, seq, _, code_ in calls:
            if code_ == 200:
                seqs[job].append(seq)
        in_order = all(s == sorted(s) for s in seqs.values())
        first, last = min(delivered.values()), max(delivered[m] for m in expected)
        return {
            "events": len(expected),
            "calls": len(calls),
            "failed_calls": sum(1 for c in calls if c[4] != 200),
            "first_to_last_s": last - first,
            "submit_to_last_s": last - started,
            "lag_after_last_job_s": last - float(last_job),
            "in_order": in_order,
            "one_id_per_event": ids_ok and set(delivered) >= set(expected),
            "statuses": counts_by_status(),
            "rate": len(expected) / max(last - first, 1e-6),
            "note": cpu_note,
        }
    finally:
        receiver.close()


@scenario("webhook-throughput")
def webhook_throughput(ctx: Context) -> Iterator[dict]:
    """Deliveries per second to one fast receiver, then to one failing 30 % of calls."""
    n = ctx.args.jobs or (300 if ctx.quick else 10000)
    receivers = ctx.args.webhook_receiver or ["fast", "failing"]
    for code in ctx.codes():
        if "fast" not in receivers:
            continue
        r = _run(ctx, code, n, 0.0, ["job.done"])
        yield {
            "scenario": "webhook-throughput",
            "code": code.label,
            "figure": f"{r['events']} job.done deliveries to one receiver answering 200 at once "
            "(2 default runworkers, defaults)",
            "value": r["rate"],
            "unit": "deliveries/s",
            "target": ">= 1,000 deliveries/s",
            "summary": f"first -> last delivery {r['first_to_last_s']:.2f}s, last delivery "
            f"{r['lag_after_last_job_s']:.2f}s after the last job's end, {r['calls']} calls, "
            f"in order {r['in_order']}, one id per event {r['one_id_per_event']}; {r['note']}",
            "details": r,
        }
    for code in ctx.codes():
        if "failing" not in receivers:
            continue
        jobs = math.ceil(n / 3)  # queued, processing, done: three events a job
        r = _run(ctx, code, jobs, 0.3, ["*"])
        yield {
            "scenario": "webhook-throughput",
            "code": code.label,
            "figure": f"{r['events']} events of {jobs} jobs to one receiver answering 500 "
            "(Retry-After 1) to 30 % of calls",
            "value": r["lag_after_last_job_s"],
            "unit": "s after the last job's end",
            "summary": f"{r['calls']} calls ({r['failed_calls']} answered 500), all delivered, "
            f"in order per job {r['in_order']}, one id per event {r['one_id_per_event']}, "
            f"submission -> last delivery {r['submit_to_last_s']:.2f}s, "
            f"{r['rate']:.0f} deliveries/s",
            "details": r,
        }


def _cursor(name: str) -> int:
    rows = sql("SELECT last_id FROM jobs_outboxcursor WHERE name = %s", [name])
    return rows[0][0] if rows else 0


SINKS = ("webhooks", "stream", "kafka")


class CursorTrace:
    """The three cursors every 50 ms, in a thread of its own, from the submission on:
    how far behind each sink was when the last job ended, and how it caught up (its
    cursor's moves after that: the ticks, their size and the time between them)."""

    def __init__(self) -> None:
        import threading

        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from django.db import connection

        try:
            while not self._stop.wait(0.05):
                rows = sql("SELECT name, last_id FROM jobs_outboxcursor WHERE name = ANY(%s)",
                           [list(SINKS)])  # fmt: skip
                self.samples.append((time.time(), dict(rows)))
        finally:
            connection.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at_end(self, last_finish: float, last: int, passed: dict[str, float]) -> dict:
        """Per sink: events behind at the last job's end, its moves after, and the rate."""
        out: dict[str, dict] = {}
        for name in SINKS:
            before = [s[name] for t, s in self.samples if t <= last_finish and name in s]
            cursor = before[-1] if before else 0
            behind = sql("SELECT count(*) FROM jobs_jobevent WHERE id > %s AND id <= %s AND "
                         "kind = 'transition'", [cursor, last])[0][0]  # fmt: skip
            moves, prev = [], cursor
            for t, s in self.samples:
                if t > last_finish and s.get(name, prev) != prev and prev < last:
                    moves.append((t, s[name] - prev))
                    prev = s[name]
            took = passed.get(name, last_finish) - last_finish
            out[name] = {"behind": behind, "moves": len(moves),
                         "ids_per_move": sum(m for _, m in moves) / max(len(moves), 1),
                         "rate": behind / took if took > 0 else None}  # fmt: skip
        return out


@scenario("drain-sinks")
def drain_sinks(ctx: Context) -> Iterator[dict]:
    """A drain of n no-op jobs by two runworkers (--concurrency 128) beside a runreaper
    with a webhook (job.done, a receiver answering 200 at once), the Redis stream and the
    Kafka sink on: the drain rate, and when each subscriber's cursor passed the last
    event (and the receiver had the last delivery) after the last job's end."""
    from harness import KafkaBroker
    from jobs.events import signing

    n = ctx.args.jobs or (300 if ctx.quick else 10000)
    concurrency = ctx.args.concurrency or 128
    broker = KafkaBroker(ctx.logdir / "tansu-sinks.log").start()
    try:
        for i, (code, variant) in enumerate(ctx.setups()):
            topic = f"bench.sinks.{i}"
            broker.create_topic(topic, partitions=12)
            reset(ctx)
            apply_variant(variant)
            sql("DELETE FROM jobs_webhookdelivery")
            sql("DELETE FROM jobs_outboxcursor WHERE name LIKE 'kafka%%'")
            placed = ctx.procs.start("outbox", "start", "kafka", "--from", "now", root=code.root)
            if placed.wait(60) != 0:
                raise RuntimeError(f"outbox start kafka failed:\n{placed.output()}")
            receiver = _receiver(ctx)
            try:
                client_id = _webhook(receiver.url, ["job.done"])
                env = {**WEBHOOK_ENV, "JOBS_KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
                       "JOBS_KAFKA_TOPIC": topic,
                       "JOBS_KAFKA_CONFIG": '{"linger.ms": 5}'}  # fmt: skip
                reaper = ctx.procs.start("runreaper", root=code.root, **env)
                # --deliveries-after-sinks: the deliveries wait until every cursor has
                # passed, so the relays have the machine to themselves (a figure, not a mode).
                later = ctx.args.deliveries_after_sinks
                queues = ["--queues", "default"] if later else []
                workers = [ctx.procs.worker("--concurrency", str(concurrency), *queues,
                                            root=code.root, ready=True, **env)
                           for _ in range(2)]  # fmt: skip
                pids = [reaper.pid], [w.pid for w in workers]
                cpu_before = [cpu_seconds(p) for p in pids] + [cpu_seconds(backend_pids())]
                first_event = sql("SELECT COALESCE(max(id), 0) FROM jobs_jobevent")[0][0]
                trace = CursorTrace()
                job_ids = _submit(client_id, n)
                wait_terminal(n, timeout=max(60, n / 200), job_ids=job_ids)
                first_claim, last_finish = sql(
                    "SELECT extract(epoch FROM min(at)), (SELECT extract(epoch FROM "
                    "max(finished_at)) FROM jobs_job WHERE id = ANY(%s::bigint[])) "
                    "FROM jobs_jobevent WHERE to_status = 'processing' "
                    "AND job_id = ANY(%s::bigint[])", [job_ids, job_ids]
                )[0]  # fmt: skip
                last = sql("SELECT max(id) FROM jobs_jobevent WHERE job_id = ANY(%s::bigint[])",
                           [job_ids])[0][0]  # fmt: skip
                passed: dict[str, float] = {}
                expected = {signing.message_id(i) for (i,) in sql(
                    "SELECT id FROM jobs_jobevent WHERE job_id = ANY(%s::bigint[]) AND "
                    "to_status = 'done'", [job_ids])}  # fmt: skip

                deliverer = (partial(ctx.procs.worker, "--queues", signing.WEBHOOK_QUEUE,
                                     root=code.root, **env) if later else None)  # fmt: skip

                def caught_up(passed=passed, last=last, expected=expected, receiver=receiver,
                              workers=workers, deliverer=deliverer) -> bool:  # fmt: skip
                    for name in ("webhooks", "stream", "kafka"):
                        if name not in passed and _cursor(name) >= last:
                            passed[name] = time.time()
                    if deliverer is not None and len(workers) == 2 and len(passed) == 3:
                        workers.append(deliverer())
                    if "receiver" not in passed:
                        delivered = _all_delivered(receiver, expected)
                        if delivered is not None:
                            passed["receiver"] = max(delivered[m] for m in expected)
                    return len(passed) == 4

                wait_until(caught_up, max(300, n / 20), "every sink caught up", interval=0.05)
                trace.stop()
                behind = trace.at_end(float(last_finish), last, passed)
                # CPU per history event relayed (the jobs', the deliveries' too) from the
                # submission to the last sink: what bounds the relays on a busy machine.
                pids = [reaper.pid], [w.pid for w in workers]  # a late webhooks worker too
                cpu = [cpu_seconds(p) for p in pids] + [cpu_seconds(backend_pids())]
                events = sql("SELECT count(*) FROM jobs_jobevent WHERE id > %s AND "
                             "kind = 'transition'", [first_event])[0][0]  # fmt: skip
                names = ("reaper", "workers", "postgres")
                per = {k: (c - b) / max(events, 1) * 1e6
                       for k, c, b in zip(names, cpu, cpu_before, strict=True)}  # fmt: skip
                for p in [*workers, reaper]:
                    p.stop()
            finally:
                receiver.close()
            after = {k: v - float(last_finish) for k, v in passed.items()}
            drain_s = float(last_finish) - float(first_claim)
            yield {
                "scenario": "drain-sinks",
                "code": labelled(code.label, variant)
                + (" (deliveries after the sinks)" if later else ""),
                "figure": f"drain {n} no-op jobs (2 runworkers, --concurrency {concurrency}) "
                "with a webhook, the Redis stream and the Kafka sink: the last event's lag",
                "value": max(after[k] for k in ("webhooks", "stream", "kafka")),
                "unit": "s after the last job's end (slowest outbox subscriber)",
                "target": "<= 2 s for each sink",
                "summary": f"drain {n / drain_s:,.0f} jobs/s; last event passed by "
                + ", ".join(f"{k} {v:.2f}s" for k, v in sorted(after.items()))
                + " after the last job's end (receiver: its last delivery); CPU per history "
                f"event ({events}): "
                + ", ".join(f"{k} {v:.0f} us" for k, v in per.items())
                + "; behind at the last job's end: "
                + ", ".join(
                    f"{k} {b['behind']} events, passed at {b['rate'] or 0:,.0f}/s in "
                    f"{b['moves']} moves of {b['ids_per_move']:,.0f} ids"
                    for k, b in behind.items()
                ),  # fmt: skip
                "brief": f"drain {n / drain_s:,.0f} jobs/s; after the last job: "
                + ", ".join(f"{k} {after[k]:.2f} s" for k in ("webhooks", "stream", "kafka")),
                "details": {
                    "jobs": n,
                    "drain_s": drain_s,
                    "after_last_job_s": after,
                    "events": events,
                    "cpu_us_per_event": per,
                    "behind_at_end": behind,
                },
            }
    finally:
        broker.stop()
