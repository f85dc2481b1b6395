"""Scrape a process's /metrics over HTTP and read samples out of the exposition format."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Scrape:
    """One scrape: every sample as (name, labels, value)."""

    samples: list[tuple[str, dict[str, str], float]]
    families: dict[str, str]  # family name -> type

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels` (0 if none)."""
        return sum(
            v
            for n, lab, v in self.samples
            if n == name and all(lab.get(k) == want for k, want in labels.items())
        )

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        return [(lab, v) for n, lab, v in self.samples if n == name]

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.samples)


def parse(text: str) -> Scrape:
    samples = []
    families = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = family.type
        for s in family.samples:
            samples.append((s.name, dict(s.labels), s.value))
    return Scrape(samples, families)


def scrape(url: str, timeout: float = 5.0) -> Scrape:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        assert r.status == 200, r.status
        return parse(r.read().decode())


def port_scrape(port: int) -> Scrape:
    return scrape(f"http://127.0.0.1:{port}/metrics")


def json_lines(text: str) -> list[dict]:
    """Every non-empty line parsed as JSON; fails on the first line that is not."""
    out = []
    for line in text.splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                raise AssertionError(f"log line is not JSON: {line!r}") from exc
    return out
