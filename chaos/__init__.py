"""The fault suite: proof that nothing is lost and no stale write wins (SPEC §1–§6).

`python -m chaos --profile short|long` runs the real stack (gunicorn API,
workers, reapers) on a scratch database and a Redis server of its own, submits
jobs over HTTP while injecting faults on a seeded schedule, lets the system
drain, and checks the invariants in `chaos.checks` over the database.
"""
