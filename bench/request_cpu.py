"""`python -m bench.request_cpu [--baseline REF] [--rounds 6] [--requests 1000]`: the CPU
of one single submission inside the API process, with no server, client or other thread in
the way: the WSGI application the servers load, called in one thread with the environ
granian passes (the process environment merged in), on a scratch database and a private
Redis, as the deployment's settings run it. Each tree runs in a process of its own, rounds
alternating between the trees; prints the thread CPU per request of each round and the
median. Reports; asserts nothing."""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time


def child(rounds: int, requests: int) -> None:
    """Runs in the tree measured (cwd), against the database and Redis in its environment."""
    import django

    django.setup()
    from jobs.models import Client
    from jobservice.wsgi import application as app  # what the servers load

    _, token = Client.create_with_token(f"request-cpu-{os.getpid()}")
    body = json.dumps({"task": "echo", "payload": {"n": 1}}).encode()
    request = {
        "REQUEST_METHOD": "POST", "PATH_INFO": "/api/v1/jobs/", "SCRIPT_NAME": "",
        "QUERY_STRING": "", "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(body)), "HTTP_AUTHORIZATION": f"Token {token}",
        "HTTP_HOST": "127.0.0.1:8000", "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8000",
        "SERVER_PROTOCOL": "HTTP/1.1", "REMOTE_ADDR": "127.0.0.1", "wsgi.url_scheme": "http",
        "wsgi.errors": sys.stderr,
    }  # fmt: skip
    base = dict(os.environ)  # granian's environ starts from the process environment

    def start_response(status: str, headers: list, exc_info=None) -> None:
        assert status.startswith("201"), status

    def submit() -> None:
        b"".join(app({**base, **request, "wsgi.input": io.BytesIO(body)}, start_response))

    for _ in range(300):  # warm: prepared statements, caches, connections
        submit()
    for _ in range(rounds):
        sys.stdin.readline()  # the parent's turn signal
        started = time.thread_time()
        for _ in range(requests):
            submit()
        print(json.dumps((time.thread_time() - started) / requests * 1000), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="Also measure the tree of this git ref.")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.rounds, args.requests)
        return

    from bench.env import PREFIX, PUBLIC_TASKS, TASK_MODULES, Code, scratch_database, setup_django
    from harness import RedisServer, service_env

    db = scratch_database().create()
    redis = RedisServer().start()
    trees = [Code()] + ([Code(args.baseline)] if args.baseline else [])
    procs = []
    try:
        setup_django(db.url(), redis.url)
        env = service_env(
            db.url(), redis.url, PREFIX, TASK_MODULES, PYTHONPATH="", JOBS_PUBLIC_TASKS=PUBLIC_TASKS
        )
        env.update(LOG_LEVEL="WARNING", DEBUG="0")
        for code in trees:
            argv = [sys.executable, "-m", "bench.request_cpu", "--child",
                    "--rounds", str(args.rounds), "--requests", str(args.requests)]  # fmt: skip
            procs.append(
                subprocess.Popen(
                    argv,
                    cwd=code.root,
                    env=env,
                    text=True,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )  # fmt: skip
            )
        figures: dict[str, list[float]] = {code.label: [] for code in trees}
        for _ in range(args.rounds):
            for code, proc in zip(trees, procs, strict=True):
                proc.stdin.write("\n")
                proc.stdin.flush()
                figures[code.label].append(json.loads(proc.stdout.readline()))
        load = os.getloadavg()[0]
        for label, values in figures.items():
            rounds = " ".join(f"{v:.3f}" for v in values)
            median = statistics.median(values)
            print(
                f"{label}: CPU per submission {median:.3f} ms median (rounds: {rounds}; "
                f"{args.requests} requests each; load {load:.2f})"
            )
        command = "python -m bench.request_cpu"
        print(f"    $ {command}" + (f" --baseline {args.baseline}" if args.baseline else ""))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for code in trees:
            code.close()
        redis.stop()
        db.drop()


if __name__ == "__main__":
    main()
