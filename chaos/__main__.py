"""`python -m chaos --profile short|long|slo [--seed N] [--duration S] [--rate R] [--keep]`.

Exit status: 0 when every invariant held, 1 on any violation, 2 when the
harness itself could not run.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys

from chaos.profiles import FAULT_KINDS, PROFILES
from harness import DEFAULT_ADMIN_URL


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="short")
    parser.add_argument("--seed", type=int, default=None, help="Replay a schedule [random].")
    parser.add_argument("--duration", type=positive(float), help="Seconds of load and faults.")
    parser.add_argument("--rate", type=positive(float), help="Submissions per second.")
    parser.add_argument("--workers", type=positive(int), help="runworker processes.")
    parser.add_argument(
        "--faults",
        help=f"Comma-separated subset of fault kinds [all: {','.join(FAULT_KINDS)}].",
    )
    parser.add_argument(
        "--keep", action="store_true", help="Keep the scratch database and the logs."
    )
    parser.add_argument(
        "--admin-url",
        default=os.environ.get("CHAOS_ADMIN_DATABASE_URL", DEFAULT_ADMIN_URL),
        help="PostgreSQL URL allowed to create databases [CHAOS_ADMIN_DATABASE_URL].",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="Log each fault as it runs.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    profile = PROFILES[args.profile]
    changes = {}
    if args.duration:
        changes["duration"] = args.duration
    if args.rate:
        changes["rate"] = args.rate
    if args.workers:
        changes["workers"] = args.workers
    if args.faults:
        kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip())
        unknown = sorted(set(kinds) - set(FAULT_KINDS))
        if unknown:
            print(f"unknown fault kind(s): {', '.join(unknown)}", file=sys.stderr)
            return 2
        changes["fault_kinds"] = kinds
    profile = profile.with_(**changes)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(message)s",
    )
    # SIGTERM (a CI timeout) unwinds like Ctrl-C, so the stack and the database are cleaned up.
    signal.signal(signal.SIGTERM, _interrupt)
    from chaos.run import run

    try:
        result = run(profile, seed, admin_url=args.admin_url, keep=args.keep,
                     echo=lambda s: print(s, flush=True))  # fmt: skip
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"harness error: {exc.__class__.__name__}: {exc}", file=sys.stderr)
        return 2
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
