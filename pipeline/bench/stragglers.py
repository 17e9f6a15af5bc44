"""`antdt bench stragglers`: the same job three ways under an injected fault, on real workers.

Ways (``train.sharding``): ``static`` deals each worker a fixed 1/N of the shards up front;
``pull`` leases shards dynamically with the controller off; ``antdt`` leases dynamically with
the straggler controller on. Scenarios (faults on worker 0, by fault injection, so rates are
known: the slowdown sleeps in proportion to the measured compute):

* ``none``        no fault;
* ``persistent``  worker 0 is ``--slowdown`` (4) times slower for the whole job;
* ``transient``   worker 0 is ``--slowdown`` times slower for its first quarter of its share;
* ``hang``        worker 0 stops for good at 20% of its share (20% into the epoch);
* ``crash``       worker 0's process exits at 30% of its share (the nanny starts a new one);
* ``contention``  no injected fault: real CPU contention. Worker 0 shares CPU 0 with a process
                  that busy-loops, the other workers get the other CPUs (use ``--workers 2`` on a
                  2-core machine, so that only worker 0 shares its core).

The dataset is sized by time (:mod:`pipeline.bench.sizing`): ``--target-s`` seconds of ideal
fault-free training on this machine, unless ``--rows`` names its size. Every run reports its
fixed costs apart (``start_s``: until every agent has its first lease; ``tail_s``: from the
last row trained until the last agent ended, the final sync round; ``fixed_s``: both).

``ideal_s`` is what perfect sharing of the measured capacity would take: every agent trains at
its measured rate (rows / busy seconds, injected slowness included) from its first lease (its
model built) until it hangs or dies (for good: never), and the rows are shared so that all
finish together. The monitor's window is ``--monitor-window`` (2 s: these jobs last tens of
seconds; the default 10 s suits jobs of hours).
``efficiency = ideal_s / wall_s`` with ``wall_s`` the training seconds. A way that cannot finish
(a hang under ``static`` or ``pull``) is stopped after ``--deadline-factor`` x the ``antdt``
way's time: it reports ``finished: false``, efficiency 0 and the rows it lost.
With ``--repeats N`` every way runs N times per scenario, interleaved with the other ways; a
way's figures are those of its median run (by efficiency); ``efficiencies`` lists every run's
efficiency and ``fixed_costs`` every run's ``[start_s, tail_s]``.

``--network`` runs the async ways on a cluster of hosts instead, the data served over HTTP and
a straggler made by a slow link (scenarios ``none`` and ``slow-link``, worker 0's link at
``--link-rate``): :mod:`pipeline.bench.stragglers_net`.

``--mode sync`` measures the synchronous mode (AntDT-DD) instead, scenarios ``none``,
``persistent`` and ``contention`` only. Its ways: ``fixed`` (sync, equal local batches:
``train.adaptive_batch: false``, what TorchRec under torchrun does), ``adaptive`` (sync, the
controller sizes each rank's local batch by its rate, the global batch unchanged) and ``async``
(the async mode with antdt sharding, the same job). A way's figure is its median run by
``samples_per_s`` (rows over the training seconds; ``steady_samples_per_s`` leaves the fixed
costs out), every run's under ``runs_samples_per_s``; a sync run also lists each worker's last
local batch (``batch_rows``), its own rate (``own_rates``: rows over its own seconds, what the
controller balances) and its CPU share (``cpu_shares``: its training thread's CPU seconds over
its own seconds, what of a core it got while it had work), by worker index. The sync ways'
global batch is 4,096 rows a rank (``RANK_BATCH`` x workers, as TorchRec under torchrun is run)
unless ``--set train.batch_size`` names it; the async way's batch is that over the workers,
each worker's step as many rows as a rank's. The dataset is sized for ``--target-s`` seconds
of fault-free synchronous training (a sync calibration run).
Each scenario reports ``adaptive_over_fixed`` and ``async_over_fixed`` (ratios of the medians,
steady ones too) against its target (adaptive >= 1.8x fixed with one worker 4x slower, >= 1.2x
under contention, >= 0.9x with none) and the ideal for this machine:

* ``fault_free_samples_per_s``: the ``fixed`` way without the fault (or the busy loop), run in
  the same invocation and interleaved with the others (with no fault, the ``fixed`` way itself);
* ``samples_per_s = fault_free x share``, ``share = (W - 1 + 1/s) / W``: the fluid ideal,
  every worker's capacity used (``W`` workers, worker 0 ``s`` times slower: ``--slowdown``, or
  under contention one over its CPU share in the ``fixed`` run, ``slowdown`` in the report)
  with the work split perfectly: one worker's capacity shrinks to ``1/s``, the rest is kept;
* ``over_fixed``: that ideal over the measured ``fixed`` rate, and ``fluid_over_fixed =
  share x s``, the same ratio were ``fixed`` exactly ``1/s`` of the fault-free rate (a
  synchronous step waits for its slowest rank): 3.25 with W = 4 and s = 4, 1.5 with W = 2 and
  a contended rank that keeps half its core;
* ``adaptive_of_ideal``, ``async_of_ideal``: the ways' rates over the ideal.

The fluid ideal assumes all of a step's work follows the local batch; a rank's share of the
global batch's embedding lookups (the tables it owns) does not, and neither do its fixed costs
per step, so even perfect batch sizes stay below it. On a machine with fewer cores than ranks
the fault-free rate is bounded by the cores, not by the ranks: a slow rank sleeping leaves its
core to the others. Under contention the contended rank is slower at everything, its part of
every collective too, which its peers wait for. An injected slowdown sleeps after the step
instead: the collectives run at full speed, but the peers wait for the whole sleep at the next
step's header, the sleep of the slow rank's fixed part too (its share of the lookups and the
dense update, what an empty step costs it), which no batch size removes: with 4 workers on 2
cores its 1-row steps took 33 ms of its own time and slept 99 ms more, its peers' steps of
5,500 rows about 105 ms of theirs, and a step of 16,384 rows lasted about 290 ms (the rest the
collectives'): adaptive stayed at 1.7x fixed.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable
from typing import Any, Literal

import dask

from pipeline.bench import emit
from pipeline.bench.jobs import Outcome, cpu_hog, echo, run_async, with_train
from pipeline.bench.sizing import sized_job
from pipeline.job.config import FaultConfig, JobConfig, Sharding

SCENARIOS = ("none", "persistent", "transient", "hang", "crash", "contention")
WAYS: tuple[Sharding, ...] = ("antdt", "pull", "static")
SYNC_SCENARIOS = ("none", "persistent", "contention")
NET_SCENARIOS = ("none", "slow-link")
"""``--network``'s scenarios (:mod:`pipeline.bench.stragglers_net`)."""
SyncWay = Literal["fixed", "adaptive", "async"]
SYNC_WAYS: tuple[SyncWay, ...] = ("fixed", "adaptive", "async")
FAULT_FREE = "fault_free"
"""The sync mode's extra way under a fault: ``fixed`` without it (the ideal's base)."""
SYNC_TARGETS = {"none": 0.9, "persistent": 1.8, "contention": 1.2}
"""The sync mode's target for ``adaptive_over_fixed`` per scenario (issues 47 and 57)."""


def scenario_faults(scenario: str, share: int, slowdown: float) -> list[FaultConfig]:
    """The faults of ``scenario`` on worker 0, whose share of the rows is ``share``."""
    if scenario == "persistent":
        return [FaultConfig(worker=0, slowdown=slowdown)]
    if scenario == "transient":
        return [FaultConfig(worker=0, slowdown=slowdown, slow_for_rows=share // 4)]
    if scenario == "hang":
        return [FaultConfig(worker=0, hang_after_rows=share // 5)]
    if scenario == "crash":
        return [FaultConfig(worker=0, crash_after_rows=3 * share // 10)]
    return []


def ideal_seconds(outcome: Outcome, rows: int, faults: list[FaultConfig]) -> float:
    """The training time of perfect sharing of the measured capacity (module docstring)."""
    hanging = {f.worker for f in faults if f.hang_after_rows is not None}
    windows = []
    for slot in outcome.slots:
        start = outcome.first_lease.get(slot.worker)
        if slot.rows <= 0 or slot.busy_s <= 0 or start is None:
            continue
        end = math.inf
        if slot.index in hanging and not slot.join:
            end = start + slot.busy_s
        elif slot.dead and slot.ended is not None:
            end = slot.ended
        windows.append((slot.rows / slot.busy_s, start, end))
    if not windows:
        return math.nan

    def done(t: float) -> float:
        return sum(rate * max(0.0, min(t, end) - start) for rate, start, end in windows)

    low, high = 0.0, 1.0
    while done(high) < rows:
        high *= 2
        if high > 1e9:
            return math.nan
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if done(mid) < rows else (low, mid)
    return high


def others_rate(outcome: Outcome) -> float:
    """Rows per second of the workers other than worker 0 (their rows from their first lease
    to their end)."""
    total = 0.0
    for slot in outcome.slots:
        start = outcome.first_lease.get(slot.worker)
        if slot.index != 0 and not slot.join and slot.ended is not None and start is not None \
                and slot.ended > start:
            total += slot.rows / (slot.ended - start)
    return total


def way_figures(outcome: Outcome, faults: list[FaultConfig]) -> dict[str, Any]:
    """One run's figures: its training seconds, ideal seconds and efficiency (0 when it did
    not finish), rows, rates, straggler actions and fixed costs."""
    summary = outcome.summary
    rows = summary.rows_trained - summary.rows_retrained + summary.rows_lost
    ideal = ideal_seconds(outcome, rows, faults)
    finished = outcome.stopped is None
    return {
        "wall_s": round(summary.train_s, 2), "finished": finished,
        "ideal_s": round(ideal, 2),
        "efficiency": round(ideal / summary.train_s, 3) if finished else 0.0,
        "rows_trained": summary.rows_trained, "rows_lost": summary.rows_lost,
        "rows_retrained": summary.rows_retrained,
        "samples_per_s": round(summary.samples_per_s),
        "others_samples_per_s": round(others_rate(outcome)),
        "straggler_actions": summary.straggler_actions, **outcome.overhead(),
        "run_id": summary.run_id}


def run_way(job: JobConfig, way: Sharding, workers: int, faults: list[FaultConfig],
            deadline_s: float | None, contention: bool = False) -> dict[str, Any]:
    """One run of ``way`` on a new LocalCluster (:func:`way_figures`)."""
    outcome = run_async(with_train(job, sharding=way, faults=faults), workers,
                        deadline_s=deadline_s, setting=cpu_hog if contention else None)
    return way_figures(outcome, faults)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median efficiency (the lower middle one of an even count), with every run's
    efficiency under ``efficiencies`` and its fixed costs under ``fixed_costs`` (start + tail
    seconds), in the order they ran."""
    efficiencies = [run["efficiency"] for run in runs]
    middle = statistics.median_low(efficiencies)
    return {**runs[efficiencies.index(middle)], "efficiencies": efficiencies,
            "fixed_costs": [[run["start_s"], run["tail_s"]] for run in runs]}


WayRunner = Callable[[Sharding, float | None], dict[str, Any]]
"""``run(way, deadline_s)``: one run of a scenario's ``way``, its figures (:func:`run_way`)."""


def run_scenario(job: JobConfig, name: str, ways: list[Sharding], workers: int,
                 faults: list[FaultConfig], deadline_factor: float, repeats: int,
                 quiet: bool, runner: WayRunner | None = None) -> dict[str, Any]:
    """Every way of one scenario, ``repeats`` times interleaved, each way's median run; in each
    repeat the ``antdt`` way's time sets the others' deadline. ``runner`` runs one way
    (default: :func:`run_way` on a LocalCluster)."""
    if runner is None:
        runner = functools.partial(_local_run, job, workers, faults, name == "contention")
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
    for repeat in range(repeats):
        deadline = None
        for way in ways:
            echo(f"{name}: {way} (repeat {repeat + 1}/{repeats})", quiet)
            run = runner(way, deadline)
            runs[way].append(run)
            if way == "antdt":
                deadline = deadline_factor * run["wall_s"] + 30.0
    return {way: median_run(way_runs) for way, way_runs in runs.items()}


def _local_run(job: JobConfig, workers: int, faults: list[FaultConfig], contention: bool,
               way: Sharding, deadline_s: float | None) -> dict[str, Any]:
    return run_way(job, way, workers, faults, deadline_s, contention=contention)


def fluid_share(workers: int, slowdown: float) -> float:
    """What of the fault-free rate perfect sharing keeps with one of ``workers`` workers
    ``slowdown`` times slower: ``(W - 1 + 1/s) / W``.

    >>> fluid_share(4, 4.0)
    0.8125
    """
    return (workers - 1 + 1 / slowdown) / workers


RANK_BATCH = 4096
"""``--mode sync``: rows a rank of the sync ways' default global batch (module docstring)."""


def sync_way_job(job: JobConfig, way: SyncWay, workers: int,
                 faults: list[FaultConfig]) -> JobConfig:
    """``job`` as the sync mode's ``way`` runs it on ``workers`` workers, with ``faults``."""
    if way == "async":
        return with_train(job, mode="async", sharding="antdt", faults=faults,
                          batch_size=max(1, job.train.batch_size // workers))
    return with_train(job, mode="sync", adaptive_batch=way == "adaptive", faults=faults)


def _rounded(value: float) -> int | None:
    return None if math.isnan(value) else round(value)


def run_sync_way(job: JobConfig, way: SyncWay, workers: int, faults: list[FaultConfig],
                 contention: bool = False) -> dict[str, Any]:
    """One run of the sync mode's ``way`` (with worker 0's core shared with a busy loop under
    ``contention``): its rates, rows, fixed costs and, by worker index, each worker's own rate,
    CPU share and last local batch."""
    outcome = run_async(sync_way_job(job, way, workers, faults), workers,
                        setting=cpu_hog if contention else None)
    summary = outcome.summary
    by_index = sorted(zip(outcome.slots, outcome.batch_rows or [None] * len(outcome.slots)),
                      key=lambda pair: pair[0].index)
    return {
        "samples_per_s": round(summary.samples_per_s),
        "steady_samples_per_s": _rounded(outcome.steady_rate()),
        "wall_s": round(summary.train_s, 2), "finished": outcome.stopped is None,
        "auc": round(summary.auc, 4), "rows_trained": summary.rows_trained,
        "rows_lost": summary.rows_lost, "rows_retrained": summary.rows_retrained,
        "own_rates": [round(slot.rows / slot.busy_s) if slot.busy_s > 0 else 0
                      for slot, _ in by_index],
        "cpu_shares": [round(slot.cpu_s / slot.busy_s, 3) if slot.busy_s > 0 else 0.0
                       for slot, _ in by_index],
        "batch_rows": [size for _, size in by_index],
        **outcome.overhead(), "run_id": summary.run_id}


def median_by_rate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median ``samples_per_s`` (the lower middle one of an even count), with every
    run's under ``runs_samples_per_s``, in the order they ran."""
    rates = [run["samples_per_s"] for run in runs]
    return {**runs[rates.index(statistics.median_low(rates))], "runs_samples_per_s": rates}


def worker_slowdown(fixed: dict[str, Any], scenario: str, slowdown: float) -> float:
    """How many times slower worker 0 is in ``scenario``: ``slowdown`` (injected) under
    ``persistent``, one over its CPU share in the ``fixed`` run under ``contention``, else 1.

    >>> worker_slowdown({"cpu_shares": [0.5, 0.98]}, "contention", 4.0)
    2.0
    """
    if scenario == "persistent":
        return slowdown
    if scenario == "contention" and fixed["cpu_shares"][0] > 0:
        return 1 / fixed["cpu_shares"][0]
    return 1.0


def sync_ratios(ways: dict[str, dict[str, Any]], scenario: str, workers: int,
                slowdown: float) -> dict[str, Any]:
    """The ratios of a sync-mode scenario's median runs ``ways`` and its ideal (the module
    docstring); ``slowdown``: the injected one (``--slowdown``)."""
    out: dict[str, Any] = {}
    fixed = ways.get("fixed")
    if fixed is None:
        return out
    for way in ("adaptive", "async"):
        if way in ways:
            out[f"{way}_over_fixed"] = round(ways[way]["samples_per_s"]
                                             / fixed["samples_per_s"], 3)
            steady, base = ways[way]["steady_samples_per_s"], fixed["steady_samples_per_s"]
            out[f"steady_{way}_over_fixed"] = round(steady / base, 3) if steady and base \
                else None
    if "adaptive_over_fixed" in out:
        target = SYNC_TARGETS[scenario]
        out["target"] = {"adaptive_over_fixed": target,
                         "met": out["adaptive_over_fixed"] >= target}
    base_run = ways.get(FAULT_FREE, fixed if scenario == "none" else None)
    if base_run is None:
        return out
    slower = worker_slowdown(fixed, scenario, slowdown)
    share = fluid_share(workers, slower)
    ideal = base_run["samples_per_s"] * share
    out["ideal"] = {"fault_free_samples_per_s": base_run["samples_per_s"],
                    "slowdown": round(slower, 3), "share": round(share, 4),
                    "samples_per_s": round(ideal),
                    "over_fixed": round(ideal / fixed["samples_per_s"], 3),
                    "fluid_over_fixed": round(share * slower, 3),
                    **{f"{way}_of_ideal": round(ways[way]["samples_per_s"] / ideal, 3)
                       for way in ("adaptive", "async") if way in ways}}
    return out


def run_sync_scenario(job: JobConfig, name: str, ways: list[SyncWay], workers: int,
                      faults: list[FaultConfig], slowdown: float, repeats: int,
                      quiet: bool) -> dict[str, Any]:
    """Every way of one sync-mode scenario (and, under a fault or contention, ``fixed``
    without it), ``repeats`` times interleaved: each way's median run and the ratios."""
    contention = name == "contention"
    order: list[tuple[str, SyncWay, list[FaultConfig], bool]] = [
        (way, way, faults, contention) for way in ways]
    if (faults or contention) and "fixed" in ways:
        order.append((FAULT_FREE, "fixed", [], False))
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, *_ in order}
    for repeat in range(repeats):
        for label, way, way_faults, hog in order:
            echo(f"{name}: {label} (repeat {repeat + 1}/{repeats})", quiet)
            runs[label].append(run_sync_way(job, way, workers, way_faults, hog))
    medians = {way: median_by_rate(way_runs) for way, way_runs in runs.items()}
    return {**medians, **sync_ratios(medians, name, workers, slowdown)}


def sync_command(names: list[str], ways: list[SyncWay], workers: int, target_s: float,
                 rows: int | None, data_dir: str | None, slowdown: float, monitor_window: str,
                 repeats: int, overrides: tuple[str, ...], as_json: bool) -> None:
    """``--mode sync``: every scenario's ways (the module docstring)."""
    overrides = (f"train.batch_size={RANK_BATCH * workers}", *overrides)
    job, sizing = sized_job(workers, target_s, rows, data_dir, overrides, as_json, mode="sync")
    result: dict[str, Any] = {"mode": "sync", "workers": workers, **sizing.as_dict(),
                              "slowdown": slowdown, "monitor_window": monitor_window,
                              "repeats": repeats, "scenarios": {}}
    with dask.config.set({"antdt.monitor.window": monitor_window}):
        for name in names:
            faults = scenario_faults(name, sizing.train_rows // workers, slowdown)
            result["scenarios"][name] = run_sync_scenario(job, name, ways, workers, faults,
                                                          slowdown, repeats, as_json)
    emit(result, as_json)
