"""Reading Prometheus' text format (Triton's metrics port, the gateway's /metrics): the samples, and sums over them."""

from __future__ import annotations

import re

SAMPLE_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
Sample = tuple[str, dict[str, str], float]


def parse(text: str) -> list[Sample]:
    """(name, labels, value) of each sample line; comments and unreadable lines are skipped."""
    samples = []
    for line in text.splitlines():
        match = SAMPLE_LINE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            samples.append((name, dict(LABEL.findall(labels or "")), float(value)))
        except ValueError:
            continue
    return samples


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """The samples of `name` whose labels include `labels`, summed (0 when there are none)."""
    return sum(v for n, have, v in samples if n == name and all(have.get(k) == x for k, x in labels.items()))
