"""`antdt bench ...`: benchmarks that measure their baseline in the same run.

Each module here adds one sub-command to :data:`bench` and prints JSON with ``--json``.
"""

from __future__ import annotations

import json
import statistics
from typing import Any, Callable

import click


@click.group()
def bench() -> None:
    """Benchmarks; each measures its baseline in the same run and reports ratios and medians."""


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Print a benchmark result: one JSON object with ``--json``, else one ``key: value`` a line."""
    if as_json:
        click.echo(json.dumps(result, sort_keys=True))
        return
    for key, value in result.items():
        click.echo(f"{key}: {value}")


def median_of(repeats: int, measure: Callable[[], float]) -> float:
    """Median of ``repeats`` calls of ``measure`` (the machines are noisy: never trust one run)."""
    return statistics.median(measure() for _ in range(repeats))
