"""The fault schedule is a pure function of seed and profile, so `--seed` replays it."""

from __future__ import annotations

from collections import defaultdict

import pytest

from chaos.faults import plan
from chaos.profiles import FAULT_KINDS, PROFILES


def held(f) -> float:
    """How long a fault holds its target, by the planner's own rule (restart/resume + slack)."""
    spans = {"worker_kill": f.value + 2, "reaper_kill": f.value + 2, "worker_stop": f.value + 1,
             "redis_restart": f.value + 1, "api_kill": 3, "orphan_submit": 5,
             "child_pause": f.value + 0.5, "detach_pending": 3}  # fmt: skip
    return spans.get(f.kind, 0.5)


def test_same_seed_same_schedule_other_seed_another():
    short = PROFILES["short"]
    assert plan(42, short) == plan(42, short)
    assert plan(42, short) != plan(43, short)


@pytest.mark.parametrize("seed", range(0, 400, 7))
def test_short_schedule_has_every_kind_and_heals_before_the_load_stops(seed):
    profile = PROFILES["short"]
    schedule = plan(seed, profile)
    assert {f.kind for f in schedule} == set(FAULT_KINDS)
    assert len(schedule) >= round(profile.duration / profile.fault_every) * 0.8
    by_target = defaultdict(list)
    for f in schedule:
        assert 2 <= f.at and f.at + held(f) <= profile.duration - 1, f
        target = f.target or ("redis" if f.kind.startswith(("redis", "dup")) else f.kind)
        by_target[target].append((f.at, f.at + held(f)))
    for target, spans in by_target.items():  # one fault at a time per target
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), target
    outages = [(f.at, f.at + held(f)) for f in schedule if f.kind in ("worker_kill", "worker_stop")]
    for a, _ in outages:  # one worker always runs
        assert sum(s <= a < e for s, e in outages) < profile.workers


def test_only_the_chosen_kinds_are_planned():
    profile = PROFILES["short"].with_(fault_kinds=("redis_flushall", "worker_stop"))
    assert {f.kind for f in plan(1, profile)} == {"redis_flushall", "worker_stop"}
    assert plan(1, profile.with_(fault_kinds=())) == []
