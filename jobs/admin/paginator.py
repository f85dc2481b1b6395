"""Counting a list page without counting a million rows."""

from __future__ import annotations

from typing import Any

from django.core.paginator import Paginator
from django.utils.functional import cached_property

from jobs import selectors


class CappedCountPaginator(Paginator):
    """Counts exactly up to `cap` rows; past that uses the planner's estimate.

    The unfiltered list reads pg_class.reltuples, a filtered one EXPLAIN's row
    estimate, so no page view scans the whole table to print a number.
    """

    cap = 10_000

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.count_is_exact = True

    @cached_property
    def count(self) -> int:
        n, self.count_is_exact = selectors.capped_count(self.object_list, self.cap)
        return n
