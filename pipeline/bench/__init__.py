"""`antdt bench ...`: benchmarks that measure their baseline in the same run.

Each sub-command lives in its own module here, defines one click command named ``command``,
prints JSON with ``--json``, and is listed in :data:`COMMANDS` (imported only when run).
"""

from __future__ import annotations

import importlib
import json
import statistics
from typing import Any, Sequence

import click

COMMANDS = {
    "chaos": "pipeline.bench.chaos",
    "checkpoint": "pipeline.bench.checkpoint",
    "data": "pipeline.bench.data",
    "hybrid": "pipeline.bench.hybrid",
    "overhead": "pipeline.bench.overhead",
    "quality": "pipeline.bench.quality",
    "retrain": "pipeline.bench.retrain",
    "scaling": "pipeline.bench.scaling",
    "sharding": "pipeline.bench.sharding",
    "stragglers": "pipeline.bench.stragglers_cli",
    "sync": "pipeline.bench.sync",
    "submit": "pipeline.bench.submit",
    "train": "pipeline.bench.train",
}


class _LazyGroup(click.Group):
    """A group whose sub-commands are imported on first use (torch is slow to import)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        command = importlib.import_module(COMMANDS[cmd_name]).command
        assert isinstance(command, click.Command)
        return command


@click.group(cls=_LazyGroup)
def bench() -> None:
    """Benchmarks; each measures its baseline in the same run and reports ratios and medians."""


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Print a benchmark result: one JSON object with ``--json``, else one ``key: value`` a line."""
    if as_json:
        click.echo(json.dumps(result, sort_keys=True))
        return
    for key, value in result.items():
        click.echo(f"{key}: {value}")


def median_of(samples: Sequence[float]) -> float:
    """The median of repeated measurements (the machines are noisy: never trust one run)."""
    return float(statistics.median(samples))
