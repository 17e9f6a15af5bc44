"""`antdt simulate`: the straggler simulator (:mod:`antdt.simulator`) from the command line.

Runs one scenario three ways (``static``, ``pull``, ``antdt``) on the real ledger, monitor and
controller with a virtual clock, and reports each strategy's efficiency (ideal makespan /
makespan), the control cost per ledger operation, the RPC rate per worker and the wall time.
"""

from __future__ import annotations

import click

from antdt.simulator import MIXES, Scenario, simulate
from pipeline.bench import emit


@click.command("simulate")
@click.option("--workers", type=click.IntRange(min=1), default=10_000, show_default=True)
@click.option("--shards", type=click.IntRange(min=1), default=1_000_000, show_default=True)
@click.option("--mix", type=click.Choice(sorted(MIXES)), default="default", show_default=True,
              help="Worker-speed model: stragglers, hangs and deaths.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--processes", type=click.IntRange(min=1), default=2, show_default=True,
              help="Run the strategies side by side in this many processes.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def command(workers: int, shards: int, mix: str, seed: int, processes: int,
            as_json: bool) -> None:
    """Simulate WORKERS training SHARDS with and without the AntDT controller."""
    result = simulate(Scenario(workers=workers, shards=shards, mix=MIXES[mix], seed=seed),
                      processes=processes)
    result["mix"] = mix
    emit(result, as_json)
