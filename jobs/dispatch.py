"""Which queue a worker looks at next: weighted polling across the queues it serves.

A worker serving several queues must not let one starve another (seed 004).
Each pop or claim visits the queues in a random order drawn by weight, so a
queue of weight 4 comes first four times as often as a queue of weight 1 while
both have work, and a queue alone with work gets every slot. Within a queue,
PostgreSQL's order (priority DESC, run_at, id) decides, or in a `fair` queue the
clients' turns (jobs.queuecontrol); Redis only says that a queue has work.

`--queues` grammar: `name[:weight],...`; `*` (optionally `*:weight`) also serves
every other queue that has work. Without weights, earlier queues weigh more:
n queues get weights n, n-1, ..., 1.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

WILDCARD = "*"


class QueueSpecError(ValueError):
    """The --queues value cannot be parsed."""


@dataclass(frozen=True)
class QueueSpec:
    """The queues a worker serves, with their weights."""

    weights: dict[str, float]
    wildcard_weight: float | None = None  # set when `*` is served
    names: tuple[str, ...] = field(default=())  # as given, for registration and logs
    weighted: frozenset[str] = frozenset()  # names (and `*`) given a weight in --queues
    excluded: frozenset[str] = frozenset()  # served elsewhere: `*` does not add them

    @property
    def serves_all(self) -> bool:
        return self.wildcard_weight is not None

    def with_queues(
        self, found: Iterable[str], defaults: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        """The weights to poll with, given the queues known to have work (for `*`).

        `defaults` (the Queue model's weights) replace the weight a queue would get
        for lack of one in --queues; a weight given there wins.
        """
        if self.wildcard_weight is None and not defaults:
            return self.weights
        out = dict(self.weights)
        if self.wildcard_weight is not None:
            for queue in found:
                if queue not in self.excluded:
                    out.setdefault(queue, self.wildcard_weight)
        for queue, weight in (defaults or {}).items():
            if (
                queue in out
                and queue not in self.weighted
                and (queue in self.weights or WILDCARD not in self.weighted)
            ):
                out[queue] = weight
        return out

    def polling_order(
        self,
        found: Iterable[str] = (),
        defaults: Mapping[str, float] | None = None,
        rng: random.Random | None = None,
    ) -> list[str]:
        """The queues to poll now in their weighted random order: `with_queues`, then
        `polling_order`, in one call."""
        return polling_order(self.with_queues(found, defaults), rng)

    def without(self, queue: str) -> QueueSpec:
        """This spec less `queue`, which `*` no longer adds either (its own worker has it)."""
        return replace(
            self,
            weights={q: w for q, w in self.weights.items() if q != queue},
            names=tuple(n for n in self.names if n != queue),
            weighted=self.weighted - {queue},
            excluded=self.excluded | {queue},
        )

    def serves(self, queue: str) -> bool:
        return queue in self.weights or (self.serves_all and queue not in self.excluded)


def parse_queues(value: str) -> QueueSpec:
    """Parse `a:4,b:1`, `a,b` or `high:5,*` into a QueueSpec."""
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not parts:
        raise QueueSpecError("at least one queue name is needed")
    explicit = any(":" in p for p in parts)
    weights: dict[str, float] = {}
    wildcard: float | None = None
    names = []
    weighted = set()
    for n, part in enumerate(parts):
        name, sep, raw = part.partition(":")
        name = name.strip()
        if not name:
            raise QueueSpecError(f"empty queue name in {part!r}")
        if sep:
            try:
                weight = float(raw)
            except ValueError:
                raise QueueSpecError(f"weight of {name!r} is not a number: {raw!r}") from None
            if not 0 < weight <= 1000:
                raise QueueSpecError(f"weight of {name!r} must be in (0, 1000]")
            weighted.add(name)
        else:
            weight = 1.0 if explicit else float(len(parts) - n)
        if name in weights or (name == WILDCARD and wildcard is not None):
            raise QueueSpecError(f"queue {name!r} given twice")
        names.append(name)
        if name == WILDCARD:
            wildcard = weight
        else:
            weights[name] = weight
    return QueueSpec(weights, wildcard, tuple(names), frozenset(weighted))


def polling_order(weights: Mapping[str, float], rng: random.Random | None = None) -> list[str]:
    """The queues in a random order where each comes first in proportion to its weight.

    Weighted sampling without replacement (Efraimidis–Spirakis: sort by u^(1/w)).
    This is the one place the weighting lives; the Queue model's weights reach it
    through QueueSpec.with_queues.
    """
    draw = (rng or random).random
    return sorted(weights, key=lambda q: draw() ** (1.0 / weights[q]), reverse=True)
