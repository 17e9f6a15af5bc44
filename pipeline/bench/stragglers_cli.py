"""`antdt bench stragglers`'s command line: the scenarios and ways on real workers
(:mod:`pipeline.bench.stragglers`), in sync mode too, or on a cluster of hosts with a slow link
(``--network``: :mod:`pipeline.bench.stragglers_net`)."""

from __future__ import annotations

from typing import Any

import click
import dask

from pipeline.bench import emit
from pipeline.bench.jobs import SET_HELP
from pipeline.bench.network import burst_for
from pipeline.bench.sizing import sized_job
from pipeline.bench.stragglers import (NET_SCENARIOS, SCENARIOS, SYNC_SCENARIOS, SYNC_WAYS, WAYS,
                                       run_scenario, scenario_faults, sync_command)
from pipeline.bench.stragglers_net import network_command


@click.command("stragglers")
@click.option("--scenario", "scenarios", default=None,
              help=f"Comma-separated scenarios among {', '.join(SCENARIOS)} (--mode sync: "
                   f"{', '.join(SYNC_SCENARIOS)}; --network: {', '.join(NET_SCENARIOS)}; "
                   "default: persistent, --network: slow-link).")
@click.option("--workers", type=click.IntRange(min=2), default=4, show_default=True)
@click.option("--target-s", type=click.FloatRange(min=1.0), default=30.0, show_default=True,
              help="Size the dataset for this many seconds of ideal training on this machine "
                   "(a calibration run measures its speed first).")
@click.option("--rows", type=click.IntRange(min=10_000), default=None,
              help="Instead of --target-s, a dataset of exactly this many synthetic rows.")
@click.option("--data", "data_dir", default=None,
              help="Where the synthetic data is made, then reused (default: "
                   ".antdt-bench/synthetic-ROWS).")
@click.option("--slowdown", type=click.FloatRange(min=1.0), default=4.0, show_default=True)
@click.option("--mode", type=click.Choice(["async", "sync"]), default="async",
              show_default=True,
              help="async: the sharding ways under each fault; sync: the synchronous mode's "
                   "fixed and adaptive local batches and the async mode (module docstring).")
@click.option("--ways", default=None,
              help=f"Comma-separated ways to run (default: all of the mode's; async: "
                   f"{','.join(WAYS)}, antdt first: it sets the others' deadline; sync: "
                   f"{','.join(SYNC_WAYS)}).")
@click.option("--deadline-factor", type=click.FloatRange(min=1.0), default=2.0,
              show_default=True)
@click.option("--monitor-window", default="2s", show_default=True,
              help="antdt.monitor.window of the runs.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs of every way per scenario, interleaved; each way reports its median "
                   "run (by efficiency) and every run's efficiency.")
@click.option("--network", is_flag=True,
              help="Run on a cluster of hosts (a network namespace each, root only), the data "
                   "served over HTTP; scenarios none and slow-link (async mode).")
@click.option("--link-rate", default="20mbit", show_default=True,
              help="--network: worker 0's link rate in the slow-link scenario (tc units).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--json", "as_json", is_flag=True)
def command(scenarios: str | None, workers: int, target_s: float, rows: int | None,
            data_dir: str | None, slowdown: float, mode: str,
            ways: str | None, deadline_factor: float, monitor_window: str, repeats: int,
            network: bool, link_rate: str, overrides: tuple[str, ...], as_json: bool) -> None:
    """Static, pull and antdt sharding under a straggler, a hang or a crash (efficiency =
    ideal_s / wall_s; targets with 4 workers, median of 3: persistent >= 0.92, the others >=
    0.90; fixed costs <= 1 s a job). With --mode sync: fixed and adaptive local batches and the
    async mode (targets: adaptive >= 1.8x fixed under a persistent straggler, >= 1.2x under
    contention, >= 0.9x with none)."""
    names = (scenarios or ("slow-link" if network else "persistent")).split(",")
    if network and mode == "sync":
        raise click.BadParameter("--network runs the async mode's ways only",
                                 param_hint="--mode")
    known = NET_SCENARIOS if network else SYNC_SCENARIOS if mode == "sync" else SCENARIOS
    for name in names:
        if name not in known:
            raise click.BadParameter(f"unknown scenario {name!r} for --mode {mode}; expected "
                                     f"one of {list(known)}", param_hint="--scenario")
    all_ways: tuple[str, ...] = SYNC_WAYS if mode == "sync" else WAYS
    wanted = all_ways if ways is None else tuple(ways.split(","))
    for way in wanted:
        if way not in all_ways:
            raise click.BadParameter(f"unknown way {way!r} for --mode {mode}; expected some "
                                     f"of {list(all_ways)}", param_hint="--ways")
    if any(item.startswith("faults") for item in overrides):
        raise click.BadParameter("each scenario injects its own faults; leave faults out",
                                 param_hint="--set")
    if mode == "sync":
        sync_command(names, [w for w in SYNC_WAYS if w in wanted], workers, target_s, rows,
                     data_dir, slowdown, monitor_window, repeats, overrides, as_json)
        return
    chosen = [w for w in WAYS if w in wanted]
    if network:
        try:
            burst_for(link_rate)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--link-rate") from exc
        network_command(names, chosen, workers, target_s, rows, data_dir, link_rate,
                        monitor_window, deadline_factor, repeats, overrides, as_json)
        return
    job, sizing = sized_job(workers, target_s, rows, data_dir, overrides, as_json)
    result: dict[str, Any] = {"workers": workers, **sizing.as_dict(), "slowdown": slowdown,
                              "monitor_window": monitor_window, "repeats": repeats,
                              "scenarios": {}}
    with dask.config.set({"antdt.monitor.window": monitor_window}):
        for name in names:
            result["scenarios"][name] = run_scenario(job, name, chosen, workers,
                                                     scenario_faults(name, sizing.train_rows
                                                                     // workers, slowdown),
                                                     deadline_factor, repeats, as_json)
    runs = result["scenarios"]
    if "none" in runs and "persistent" in runs and "antdt" in chosen:
        before = runs["none"]["antdt"]["others_samples_per_s"]
        result["straggler_tolerance"] = round(
            runs["persistent"]["antdt"]["others_samples_per_s"] / before, 3) if before else None
    emit(result, as_json)
