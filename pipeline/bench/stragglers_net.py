"""`antdt bench stragglers --network`: the async ways on a cluster of hosts, a straggler made by
a slow link rather than by a slow CPU (issue 61).

Each run is a new :class:`~pipeline.bench.network.NetworkCluster` of ``--workers`` workers, the
job's training data served over HTTP from the host's namespace
(:func:`~pipeline.bench.runs_net.run_on_network`): a worker reads its rows over its link, as a
production job reads its Parquet logs from remote storage. Scenarios:

* ``none``       every link unlimited (the namespaced cluster's own baseline);
* ``slow-link``  worker 0's link at ``--link-rate`` (20 Mbit/s) each way, its CPU free: its
                 reads, its commits and its sync rounds with its peers all cross that link.

The ways, the ideal and the efficiency are those of :mod:`pipeline.bench.stragglers`
(``ideal_s``: every agent at its measured rate, rows over busy seconds, its reading over the link
included; ``efficiency = ideal_s / wall_s``), every way ``--repeats`` times interleaved, each its
median run. The dataset is sized by time on a LocalCluster of as many workers (the CPUs'
capacity, :mod:`pipeline.bench.sizing`). Each run adds what crossed the links, by worker index
(:class:`~pipeline.bench.runs_net.NetRun`: exchanges, bytes per round, the sync waits, the data
and link bytes) and ``slow_link_actions``, the controller's actions on worker 0 by kind.
A scenario reports ``antdt_over_static`` (the efficiencies' ratio) and the target: antdt's
efficiency at least :data:`TARGET` with one link at 20 Mbit/s.
"""

from __future__ import annotations

import functools
from typing import Any

from pipeline.bench import emit
from pipeline.bench.jobs import with_train
from pipeline.bench.runs_net import run_on_network
from pipeline.bench.sizing import sized_job
from pipeline.bench.stragglers import run_scenario, way_figures
from pipeline.job.config import JobConfig, Sharding

TARGET = 0.85
"""antdt's efficiency with one worker's link at 20 Mbit/s (issue 61)."""


def link_rates(scenario: str, workers: int, rate: str) -> list[str | None]:
    """Each worker's link rate in ``scenario`` (None: unlimited).

    >>> link_rates("slow-link", 3, "20mbit")
    ['20mbit', None, None]
    """
    return [rate if scenario == "slow-link" and i == 0 else None for i in range(workers)]


def run_net_way(job: JobConfig, workers: int, rates: list[str | None], monitor_window: str,
                way: Sharding, deadline_s: float | None) -> dict[str, Any]:
    """One run of ``way`` on a new cluster of hosts with links at ``rates``: the figures of
    :func:`~pipeline.bench.stragglers.way_figures` and what crossed the links."""
    run = run_on_network(with_train(job, sharding=way, faults=()), workers, rates,
                         deadline_s=deadline_s,
                         env={"DASK_ANTDT__MONITOR__WINDOW": monitor_window})
    return {**way_figures(run.outcome, []), **run.as_dict(),
            "slow_link_actions": run.actions[0]}


def scenario_ratios(ways: dict[str, dict[str, Any]], scenario: str) -> dict[str, Any]:
    """``antdt_over_static`` and, under ``slow-link``, the target, of a scenario's median
    runs.

    >>> scenario_ratios({"antdt": {"efficiency": 0.9}, "static": {"efficiency": 0.6}},
    ...                 "slow-link")
    {'antdt_over_static': 1.5, 'target': {'antdt_efficiency': 0.85, 'met': True}}
    """
    out: dict[str, Any] = {}
    antdt, static = ways.get("antdt"), ways.get("static")
    if antdt is not None and static is not None and static["efficiency"] > 0:
        out["antdt_over_static"] = round(antdt["efficiency"] / static["efficiency"], 3)
    if antdt is not None and scenario == "slow-link":
        out["target"] = {"antdt_efficiency": TARGET, "met": antdt["efficiency"] >= TARGET}
    return out


def network_command(names: list[str], ways: list[Sharding], workers: int, target_s: float,
                    rows: int | None, data_dir: str | None, link_rate: str,
                    monitor_window: str, deadline_factor: float, repeats: int,
                    overrides: tuple[str, ...], as_json: bool) -> None:
    """``--network``: every scenario's ways on clusters of hosts (the module's docstring)."""
    job, sizing = sized_job(workers, target_s, rows, data_dir, overrides, as_json)
    result: dict[str, Any] = {"network": True, "workers": workers, **sizing.as_dict(),
                              "link_rate": link_rate, "monitor_window": monitor_window,
                              "repeats": repeats, "scenarios": {}}
    for name in names:
        rates = link_rates(name, workers, link_rate)
        runner = functools.partial(run_net_way, job, workers, rates, monitor_window)
        medians = run_scenario(job, name, ways, workers, [], deadline_factor, repeats, as_json,
                               runner=runner)
        result["scenarios"][name] = {**medians, **scenario_ratios(medians, name)}
    emit(result, as_json)
