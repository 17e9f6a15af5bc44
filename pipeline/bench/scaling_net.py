"""`antdt bench scaling --network`: the async job on a cluster of hosts, every worker's link at a
rate, beside the same job on loopback (issue 61: what the model sync's rounds cost on a link).

For each ``--link-rate`` (``tc`` units, default ``1gbit,100mbit``) the job runs on a new
:class:`~pipeline.bench.network.NetworkCluster` of the most ``--workers`` (one thread each),
every worker's link at that rate each way and the training data served over HTTP from the host's
namespace (:func:`~pipeline.bench.runs_net.run_on_network`); the baseline, ``loopback``, is the
same job on a LocalCluster reading local files (:func:`~pipeline.bench.runs_net.run_on_loopback`).
The job is sized by time on a LocalCluster (:mod:`pipeline.bench.sizing`). Each repeat runs every
configuration once, odd repeats in the reverse order; each figure is the median over repeats,
``per_repeat`` keeps every run's.

A configuration reports ``samples_per_s`` (rows over training seconds) and ``of_loopback`` (that
over loopback's), and what its sync rounds cost: ``exchanges`` (the workers' rounds together),
``bytes_per_round`` (the tensor bytes a worker pulled in one round), ``rounds_per_s`` (a
worker's rounds over the training seconds), ``sync_wait_s`` (the seconds the workers' training
waited for rounds, together) and, on a link, ``link_mbit_per_s`` (the bits that crossed a
worker's link a second, both ways, over the training seconds: data, messages and rounds) and
``data_bytes`` (the training data the workers read, together). How long one round takes is not
reported: no agent or job record says it yet.
"""

from __future__ import annotations

from typing import Any

from pipeline.bench import emit, median_of
from pipeline.bench.jobs import echo
from pipeline.bench.runs_net import NetRun, run_on_loopback, run_on_network
from pipeline.bench.sizing import sized_job

LOOPBACK = "loopback"


def run_figures(run: NetRun, workers: int) -> dict[str, Any]:
    """One run's figures (the module's docstring; a loopback run has no link figures)."""
    summary = run.outcome.summary
    seconds = summary.train_s
    figures: dict[str, Any] = {
        "samples_per_s": round(summary.samples_per_s), "train_s": round(seconds, 2),
        "exchanges": sum(run.exchanges), "bytes_per_round": run.as_dict()["bytes_per_round"],
        "rounds_per_s": round(sum(run.exchanges) / workers / seconds, 3) if seconds else None,
        "sync_wait_s": round(sum(s or 0.0 for s in run.sync_wait_s), 2),
        **run.outcome.overhead()}
    if any(run.rates):
        figures["link_mbit_per_s"] = round(sum(run.link_bytes) * 8 / workers / seconds / 1e6, 2)
        figures["data_bytes"] = sum(run.data_bytes)
    return figures


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of every numeric figure of ``runs`` (None where a run has none)."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [run[key] for run in runs if run.get(key) is not None]
        out[key] = round(median_of(values), 3) if values else None
    return out


def network_command(workers: int, target_s: float, rows: int | None, data_dir: str | None,
                    rates: list[str], repeats: int, overrides: tuple[str, ...],
                    as_json: bool) -> None:
    """``--network``: the job on loopback and at each link rate (the module's docstring)."""
    job, sizing = sized_job(workers, target_s, rows, data_dir, overrides, as_json)
    labels = [LOOPBACK, *rates]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    for repeat in range(repeats):
        for label in labels if repeat % 2 == 0 else labels[::-1]:
            echo(f"repeat {repeat + 1}/{repeats}: {workers} workers, {label}", as_json)
            run = run_on_loopback(job, workers) if label == LOOPBACK else \
                run_on_network(job, workers, [label] * workers)
            runs[label].append(run_figures(run, workers))
    configs = {label: medians(label_runs) for label, label_runs in runs.items()}
    base = configs[LOOPBACK]["samples_per_s"]
    for figures in configs.values():
        figures["of_loopback"] = round(figures["samples_per_s"] / base, 3) if base else None
    emit({"network": True, "workers": workers, **sizing.as_dict(), "repeats": repeats,
          "sync_period": str(job.train.sync_period), "configs": configs,
          "per_repeat": [{label: runs[label][r] for label in labels} for r in range(repeats)]},
         as_json)
