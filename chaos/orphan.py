"""A process that commits job rows and dies before their Redis push (SPEC §1).

`python -m chaos.orphan COUNT SEED` (Django settings from the environment):
inserts COUNT jobs through `jobs.services.submit` in one transaction, and exits
with `os._exit` from the first on-commit hook — registered before submit's own
push hooks, so the rows are committed and the pushes never run. What remains
are `queued` rows with no signal, as after an API process killed between commit
and push; the reaper's lost-signal sweep (or polling) must still run them.

Rows go straight through the service, not the API's validation, so some carry
an unknown task or a payload the task refuses: the worker must fail those at
once (permanent), without retries. Prints "<id> <kind>" per row before exiting.
"""

from __future__ import annotations

import os
import random
import sys

KINDS: dict[str, tuple[str, dict]] = {
    "orphan_echo": ("echo", {"orphan": True}),
    "orphan_record": ("demo.record", {}),
    "orphan_unknown_task": ("chaos.no-such-task", {}),
    "orphan_invalid_payload": ("demo.record", {"seconds": "soon"}),
}
WEIGHTS = (6, 4, 1, 1)


def main(argv: list[str]) -> None:
    count, seed = int(argv[0]), int(argv[1])
    import django

    django.setup()
    from django.db import transaction

    from jobs import services

    rng = random.Random(seed)
    made: list[tuple[int, str]] = []

    def die_before_push() -> None:
        sys.stdout.write("".join(f"{job_id} {kind}\n" for job_id, kind in made))
        sys.stdout.flush()
        os._exit(0)

    with transaction.atomic():
        transaction.on_commit(die_before_push)  # runs first: submit's pushes never do
        for kind in rng.choices(list(KINDS), WEIGHTS, k=count):
            task, payload = KINDS[kind]
            job, _ = services.submit(task, payload, actor="app")
            made.append((job.pk, kind))
    raise SystemExit("on-commit hook did not run")  # unreachable if the commit succeeded


if __name__ == "__main__":
    main(sys.argv[1:])
