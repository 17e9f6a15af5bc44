"""What a finished job reports: the summary printed by the CLI, logged to MLflow, read by DAGs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import posixpath
import re
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

import fsspec

_DATE = re.compile(r"date=(\d{4}-\d{2}-\d{2})")


LOWER_IS_BETTER = frozenset({
    "logloss", "wall_s", "train_s", "straggler_actions", "rows_lost", "rows_retrained",
    "rows_quarantined", "rows_replayed", "agents_dead", "checkpoints.write_s_median"})
"""Summary metrics that improve downwards (with every name ending in ``loss``)."""


def higher_is_better(metric: str) -> bool:
    """Which way ``metric`` improves: lower for losses, times, and rows lost or set aside;
    higher for everything else (AUC, throughput, rows trained).

    >>> higher_is_better("auc"), higher_is_better("logloss"), higher_is_better("train.loss")
    (True, False, False)
    """
    return not (metric in LOWER_IS_BETTER or metric.endswith("loss"))


class ProgressSink(Protocol):
    """Where a job reports its progress in rows (the CLI's progress bar, or nothing)."""

    def total(self, n: int) -> None: ...

    def advance(self, n: int) -> None: ...


@dataclass(frozen=True)
class JobSummary:
    """The outcome of one training job (``--json`` prints exactly these keys)."""

    run_id: str
    mode: str
    workers: int
    auc: float
    logloss: float
    oracle_auc: float | None
    rows_trained: int
    rows_lost: int
    rows_retrained: int
    rows_quarantined: int
    wall_s: float
    samples_per_s: float
    train_s: float = math.nan
    """Seconds of training (first agent started to last agent ended; local mode: the loop)."""
    straggler_actions: int = 0
    """Actions the straggler controller applied (0 in the local mode or without a controller)."""
    tracking_uri: str = ""
    """The MLflow tracking URI the run went to (a password in it shown as ``***``)."""
    experiment_id: str = ""
    timeline: str | None = None
    """Where the run's timeline PNG is: a local path, or its artifact URI (async mode only)."""
    rows_replayed: int = 0
    """Rows a resumed job trained again: trained past its checkpoint before the loss."""
    registered_model: str | None = None
    """The registered model the run's model became a version of (None: not registered)."""
    registered_version: str | None = None
    """That version (a string, as MLflow's URIs and REST API spell it: ``models:/NAME/3``)."""
    adapted: str | None = None
    """Why the job trained on fewer workers than it asked for (``train.min_batches_per_worker``;
    None: it did not)."""
    model_dir: str | None = None
    """Where a sync job's ranks wrote the final model, each its own part, because it does not
    fit one worker (None: the model is in the run). Such a model is not evaluated (AUC nan):
    load it with ``models.sharded.read_train_step`` on a machine that holds it, or on ranks
    with ``ShardedTrainStep.load_shards``."""
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    """Where the command's seconds went, by step (:mod:`pipeline.job.phases`): a cluster job's
    hooks return the steps of finishing they timed, its client adds its own and the master's."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> JobSummary:
        """The summary :meth:`to_dict` gave (a cluster job's hooks return it as plain data)."""
        return cls(**{name: raw[name] for name in cls.__dataclass_fields__ if name in raw})

    def metrics(self) -> dict[str, float]:
        """The numeric fields, as final MLflow metrics."""
        return {k: float(v) for k, v in self.to_dict().items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def lines(self) -> list[str]:
        """A human-readable summary, AUC next to the best any model can reach."""
        best = f"   (oracle {self.oracle_auc:.4f}, gap {self.oracle_auc - self.auc:.4f})" \
            if self.oracle_auc is not None else ""
        return [
            f"run {self.run_id} ({self.mode}, {self.workers} worker{'s' * (self.workers != 1)})",
            f"AUC      {self.auc:.4f}{best}",
            f"logloss  {self.logloss:.4f}",
            f"rows     trained {self.rows_trained:,}  lost {self.rows_lost:,}  "
            f"retrained {self.rows_retrained:,}  quarantined {self.rows_quarantined:,}"
            + (f"  replayed {self.rows_replayed:,}" if self.rows_replayed else ""),
            f"speed    {self.samples_per_s:,.0f} samples/s, {self.wall_s:.1f} s wall",
            f"control  {self.straggler_actions:,} straggler action(s)",
            *([f"adapted  {self.adapted}"] if self.adapted is not None else []),
            *([f"model    written in parts by the ranks (larger than one worker, not "
               f"evaluated): {self.model_dir}"] if self.model_dir is not None else []),
            *([f"registered {self.registered_model} version {self.registered_version}"]
              if self.registered_model is not None else []),
            *self.next_steps(),
        ]

    def next_steps(self) -> list[str]:
        """How to look at the run: MLflow's UI (started on the run's own store when it is not a
        server), the timeline picture, and how to promote the version it registered."""
        if not self.tracking_uri:
            return []
        page = run_page(self.tracking_uri, self.experiment_id, self.run_id)
        if self.tracking_uri.startswith(("http://", "https://")):
            steps = ["", "next", f"  the run   open {page}"]
        else:
            steps = ["", "next", f"  the run   mlflow ui --backend-store-uri {self.tracking_uri}",
                     f"            then open {page}"]
        if self.timeline is not None:
            steps.append(f"  timeline  {_shown(self.timeline)}")
        if self.registered_model is not None:
            steps.append(f"  promote   antdt promote {self.registered_model} --version "
                         f"{self.registered_version} --tracking-uri {self.tracking_uri}")
        return steps

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def run_page(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The web page of a run: on the tracking server, or on ``mlflow ui`` started on a local
    store (at its default address).

    >>> run_page("http://mlflow:5000/", "1", "ab12")
    'http://mlflow:5000/#/experiments/1/runs/ab12'
    >>> run_page("sqlite:///mlflow.db", "1", "ab12")
    'http://127.0.0.1:5000/#/experiments/1/runs/ab12'
    """
    server = tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) \
        else "http://127.0.0.1:5000"
    return f"{server}/#/experiments/{experiment_id}/runs/{run_id}"


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it is below it."""
    if "://" in path:
        return path
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def oracle_auc(schema_path: str, files: Sequence[str]) -> float | None:
    """The oracle AUC of ``files`` from ``oracle.json`` beside the schema (synthetic data only).

    The oracle stores one AUC per day (``date=YYYY-MM-DD`` partitions); files spanning several
    days get the row-weighted mean. ``None`` when there is no oracle or a day is not in it.
    """
    oracle_path = posixpath.join(posixpath.dirname(schema_path), "oracle.json")
    try:
        with fsspec.open(oracle_path, "r") as fh:
            per_day = json.load(fh)["per_day"]
    except FileNotFoundError:
        return None
    days = {m.group(1) for f in files if (m := _DATE.search(f))}
    if not days or not days <= set(per_day):
        return None
    weights = [per_day[d]["rows"] for d in sorted(days)]
    return sum(per_day[d]["auc"] * w for d, w in zip(sorted(days), weights)) / sum(weights)
