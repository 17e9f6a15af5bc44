"""``antdt sweep``: one job over a grid of its settings (or a random sample of the grid), every
trial one MLflow run nested under the sweep's own run, run on a Dask cluster side by side as far
as its workers allow::

    the grid (--grid key=v1,v2 ...) ─► every trial's job loaded and validated here: a bad key or
      value is refused by name before anything runs
      ─► the parent run (the base config, the grid) ─► trials start while they fit the cluster:
         a local-mode trial is one task on one worker, an async trial a job on
         ``train.workers`` of them (the least busy: :class:`antdt.jobs.JobPlan` ``workers``)
      ─► a trial that fails is recorded as failed with its error (its run ``FAILED``), the others
         go on ─► the best trial by the metric, on the parent run and in the result

``antdt compare --runs PARENT`` shows every trial with its data side. Trials never register a
model (a grid would fill the registry with versions nobody serves); with ``register``, the best
trial's model becomes a version once the sweep is done, for ``antdt promote`` to judge.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from antdt.errors import AntdtError, ConfigError
from pipeline.job.config import JobConfig, load_job
from pipeline.job.report import JobSummary, ProgressSink, higher_is_better

logger = logging.getLogger(__name__)

POLL_S = 0.25
"""How often the sweep looks at its running trials."""

@dataclass(frozen=True)
class Grid:
    """The values each key takes; a trial is one value per key.

    >>> grid = Grid.parse(["train.sparse_lr=0.01,0.05", "model.dense_arch=[64,32],[32]"])
    >>> for trial in grid.trials()[:2]:
    ...     print(trial)
    {'train.sparse_lr': '0.01', 'model.dense_arch': '[64,32]'}
    {'train.sparse_lr': '0.01', 'model.dense_arch': '[32]'}
    >>> len(grid.trials()), len(grid.trials(sample=3, seed=0))
    (4, 3)
    """

    axes: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def parse(cls, specs: Sequence[str]) -> Grid:
        """``key=v1,v2`` per spec; values are YAML as in ``--set`` (a comma inside brackets or
        braces belongs to the value)."""
        axes: dict[str, tuple[str, ...]] = {}
        for spec in specs:
            key, sep, text = spec.partition("=")
            key = key.strip()
            values = tuple(v.strip() for v in _split(text))
            if not sep or not key or not values or not all(values):
                raise ConfigError(f"--grid expects key.path=value1,value2,..., found {spec!r}")
            if key in axes:
                raise ConfigError(f"--grid {key} is given twice")
            axes[key] = values
        if not axes:
            raise ConfigError("a sweep needs at least one --grid key.path=value1,value2,...")
        return cls(tuple(axes.items()))

    def trials(self, sample: int | None = None, seed: int = 0) -> list[dict[str, str]]:
        """Every combination, in order; ``sample``: that many of them drawn at random without
        repeats (reproducible from ``seed``), in grid order."""
        keys = [key for key, _ in self.axes]
        every = [dict(zip(keys, values))
                 for values in itertools.product(*(values for _, values in self.axes))]
        if sample is None or sample >= len(every):
            return every
        chosen = sorted(random.Random(seed).sample(range(len(every)), sample))
        return [every[i] for i in chosen]


def _split(text: str) -> Iterator[str]:
    """``text`` split at the commas outside brackets and braces."""
    depth, start = 0, 0
    for i, char in enumerate(text):
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            yield text[start:i]
            start = i + 1
    if text:
        yield text[start:]


@dataclass
class Trial:
    """One trial: its values, its job, how many workers it takes, and how it ended."""

    index: int
    values: dict[str, str]
    job: JobConfig
    width: int
    state: str = "pending"
    """``pending``, ``running``, ``finished`` or ``failed``."""
    run_id: str | None = None
    summary: JobSummary | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        shown = " ".join(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in self.values.items())
        return f"trial {self.index}: {shown}"

    def to_dict(self, metric: str) -> dict[str, Any]:
        return {"trial": self.index, "values": self.values, "state": self.state,
                "run_id": self.run_id, "metric": _value(self, metric), "error": self.error,
                "summary": None if self.summary is None else self.summary.to_dict()}


def check_metric(metric: str) -> str:
    """``metric`` if it is a figure of a job's summary (what picks the best trial)."""
    known = sorted(f.name for f in fields(JobSummary)
                   if str(f.type).split(" ")[0] in ("float", "int"))
    if metric not in known:
        raise ConfigError(f"--metric {metric!r}: expected a figure of a job's summary, one of "
                          f"{', '.join(known)}")
    return metric


def plan_trials(job_path: str, overrides: Sequence[str], grid: Grid, *,
                sample: int | None = None, seed: int = 0) -> list[Trial]:
    """The trials of ``grid`` over the job at ``job_path`` (with ``overrides`` first), each
    job loaded and validated: a key or value the job config refuses raises here, naming it,
    before anything runs."""
    for key, values in grid.axes:  # each key alone first, so an error names the key
        for value in values:
            try:
                load_job(job_path, [*overrides, f"{key}={value}"])
            except ConfigError as exc:
                raise ConfigError(f"--grid {key}={value}: {exc}") from exc
    trials = []
    for index, chosen in enumerate(grid.trials(sample, seed)):
        try:
            job = load_job(job_path, [*overrides, *(f"{k}={v}" for k, v in chosen.items())])
        except ConfigError as exc:
            shown = ", ".join(f"{k}={v}" for k, v in chosen.items())
            raise ConfigError(f"--grid {shown}: {exc}") from exc
        # trials never register a model (see the module docstring)
        job = replace(job, mlflow=replace(job.mlflow, registered_model=None))
        width = 1 if job.train.mode == "local" else job.train.workers
        trials.append(Trial(index, chosen, job, width))
    return trials


@dataclass
class SweepResult:
    """A finished sweep: its parent run, its trials and the best of them by ``metric``."""

    parent_run_id: str
    experiment_id: str
    tracking_uri: str
    metric: str
    trials: list[Trial]
    best: Trial | None = field(default=None)
    registered: tuple[str, str] | None = None
    """The registered model and version the best trial's model became (None: not asked)."""

    def to_dict(self) -> dict[str, Any]:
        return {"parent_run_id": self.parent_run_id, "experiment_id": self.experiment_id,
                "tracking_uri": self.tracking_uri, "metric": self.metric,
                "registered": None if self.registered is None else
                {"model": self.registered[0], "version": self.registered[1]},
                "best": None if self.best is None else self.best.to_dict(self.metric),
                "trials": [trial.to_dict(self.metric) for trial in self.trials]}


def best_of(trials: Sequence[Trial], metric: str) -> Trial | None:
    """The finished trial with the best ``metric`` (None: none finished with it)."""
    scored = [t for t in trials if t.state == "finished" and _value(t, metric) is not None]
    if not scored:
        return None
    sign = 1.0 if higher_is_better(metric) else -1.0
    return max(scored, key=lambda t: sign * float(_value(t, metric) or 0.0))


def _value(trial: Trial, metric: str) -> float | None:
    if trial.summary is None:
        return None
    value = trial.summary.metrics().get(metric)
    return None if value is None or value != value else value  # NaN: no value


def run_sweep(trials: list[Trial], grid: Grid, *, metric: str = "auc",
              workers: int | None = None, scheduler: str | None = None,
              security: Any = None, progress: ProgressSink | None = None,
              register: str | None = None) -> SweepResult:
    """Run ``trials`` under one parent run on the cluster at ``scheduler`` (or a new
    LocalCluster of ``workers``, default: enough for the widest trial and this machine's
    cores), as many at once as fit its workers; the result with the best trial, whose model
    becomes a version of ``register`` when given."""
    from antdt.jobs import JobClient
    from pipeline.tracking.tracking import experiment, resolved_uri
    from pipeline.tracking.uris import redact
    from pipeline.training.local_cluster import connect

    base = trials[0].job
    uri = resolved_uri(base)
    experiment_id = experiment(uri, base.mlflow.experiment)
    parent = _open_parent(uri, experiment_id, base, grid, metric, len(trials))
    result = SweepResult(parent, experiment_id, redact(uri), metric, trials)
    if progress is not None:
        progress.total(len(trials))
    local = None if scheduler is not None else \
        workers or max(os.cpu_count() or 1, *(t.width for t in trials))
    status = "FAILED"
    try:
        with connect(local, scheduler, security=security) as client, \
                JobClient(client) as jobs:
            _Runner(client, jobs, parent, uri, experiment_id, progress).run(trials)
        result.best = best_of(trials, metric)
        best = result.best
        if register is not None and best is not None and best.summary is not None:
            from pipeline.tracking.registry import register_run

            result.registered = (register, register_run(uri, best.summary.run_id, register,
                                                        best.summary))
        status = "FINISHED" if any(t.state == "finished" for t in trials) else "FAILED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        _close_parent(uri, parent, result, status)
    return result


def _open_parent(uri: str, experiment_id: str, base: JobConfig, grid: Grid, metric: str,
                 trials: int) -> str:
    from mlflow import MlflowClient
    from mlflow.entities import Param

    from pipeline.tracking.tracking import flatten, public_config

    client = MlflowClient(uri)
    run = client.create_run(experiment_id, run_name=f"{base.name}-sweep",
                            tags={"antdt.sweep": "parent", "antdt.job": base.name})
    params = [Param(f"sweep.{key}", ",".join(values)) for key, values in grid.axes]
    params += [Param("sweep.metric", metric), Param("sweep.trials", str(trials))]
    params += [Param(key, str(value)[:6000])
               for key, value in flatten(public_config(base)).items()
               if key not in dict(grid.axes)]
    for i in range(0, len(params), 100):
        client.log_batch(run.info.run_id, params=params[i:i + 100])
    return str(run.info.run_id)


def _close_parent(uri: str, parent: str, result: SweepResult, status: str) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    counts = {state: sum(t.state == state for t in result.trials)
              for state in ("finished", "failed")}
    for state, count in counts.items():
        client.log_metric(parent, f"trials_{state}", count)
    if result.best is not None and result.best.run_id is not None:
        value = _value(result.best, result.metric)
        if value is not None:
            client.log_metric(parent, f"best_{result.metric}", value)
        client.set_tag(parent, "antdt.sweep.best_run", result.best.run_id)
        client.set_tag(parent, "antdt.sweep.best_trial", str(result.best.index))
    client.set_terminated(parent, status)


def local_trial(job: JobConfig, tags: Mapping[str, str], run_name: str) -> dict[str, Any]:
    """A local-mode trial, in a task on a worker: its summary as plain data."""
    from pipeline.training.local import train_local

    return train_local(job, tags=tags, run_name=run_name).to_dict()


class _Runner:
    """Starts trials while they fit the cluster's workers and collects them as they end."""

    def __init__(self, client: Any, jobs: Any, parent: str, uri: str, experiment_id: str,
                 progress: ProgressSink | None) -> None:
        self.client, self.jobs = client, jobs
        self.parent, self.uri, self.experiment_id = parent, uri, experiment_id
        self.progress = progress
        self.capacity = len(client.scheduler_info()["workers"])
        self.running: dict[int, tuple[Trial, Any]] = {}
        """Per trial index: the trial and its task's future (local) or job id (async)."""

    def run(self, trials: list[Trial]) -> None:
        pending = deque(trials)
        try:
            while pending or self.running:
                while pending and self._free() >= min(pending[0].width, self.capacity):
                    self._start(pending.popleft())
                self._collect()
                if self.running:
                    time.sleep(POLL_S)
        except BaseException:
            self._stop_running()
            raise

    def _free(self) -> int:
        return self.capacity - sum(min(t.width, self.capacity) for t, _ in self.running.values())

    def _tags(self, trial: Trial) -> dict[str, str]:
        return {"mlflow.parentRunId": self.parent, "antdt.sweep": "trial",
                "antdt.sweep.parent": self.parent, "antdt.sweep.trial": str(trial.index),
                "antdt.sweep.values": " ".join(f"{k}={v}" for k, v in trial.values.items())}

    def _start(self, trial: Trial) -> None:
        from pipeline.training.cluster import job_spec

        trial.state = "running"
        logger.info("starting %s", trial.name)
        try:
            if trial.job.train.mode == "local":
                handle: Any = self.client.submit(local_trial, trial.job, self._tags(trial),
                                                 trial.name, pure=False,
                                                 key=f"antdt-trial-{self.parent}-{trial.index}")
            else:
                spec = job_spec(trial.job, workers=min(trial.width, self.capacity),
                                run_tags=self._tags(trial), run_name=trial.name)
                handle = self.jobs.submit(spec, job_id=f"sweep-{self.parent[:8]}-"
                                                       f"{trial.index}")["job"]["job_id"]
        except AntdtError as exc:  # bad data or a refused job: this trial fails, not the sweep
            self._failed(trial, f"{type(exc).__name__}: {exc}")
            return
        self.running[trial.index] = (trial, handle)

    def _collect(self) -> None:
        from pipeline.training.following import outcome

        for index, (trial, handle) in list(self.running.items()):
            if isinstance(handle, str):
                record = self.jobs.status(handle)
                if record["state"] not in ("finished", "failed", "cancelled"):
                    continue
                trial.run_id = (record.get("run") or {}).get("run_id")
                try:
                    self._finished(trial, outcome(record))
                except AntdtError as exc:
                    self._failed(trial, str(exc))
            elif handle.done():
                if handle.status == "finished":
                    self._finished(trial, JobSummary.from_dict(handle.result()))
                elif handle.status == "error":
                    error = handle.exception()
                    self._failed(trial, f"{type(error).__name__}: {error}")
                else:
                    self._failed(trial, f"its task was {handle.status}")
            else:
                continue
            del self.running[index]

    def _finished(self, trial: Trial, summary: JobSummary) -> None:
        trial.state, trial.summary, trial.run_id = "finished", summary, summary.run_id
        self._advance()

    def _failed(self, trial: Trial, error: str) -> None:
        """A failed trial keeps (or gets) a run, ``FAILED`` with its error, under the parent."""
        trial.state, trial.error = "failed", error
        logger.warning("%s failed: %s", trial.name, error)
        trial.run_id = trial.run_id or self._run_of(trial)
        if trial.run_id is None:
            from pipeline.tracking.tracking import Tracker

            tracker = Tracker.start(trial.job, mode=trial.job.train.mode, tags=self._tags(trial),
                                    tracking_uri=self.uri, experiment_id=self.experiment_id,
                                    run_name=trial.name)
            tracker.end("FAILED", error)
            trial.run_id = tracker.run_id
        self._advance()

    def _run_of(self, trial: Trial) -> str | None:
        """The run a failed trial opened before it failed, if any."""
        from mlflow import MlflowClient

        runs = MlflowClient(self.uri).search_runs(
            [self.experiment_id], max_results=1,
            filter_string=f"tags.`antdt.sweep.parent` = '{self.parent}' and "
                          f"tags.`antdt.sweep.trial` = '{trial.index}'")
        return str(runs[0].info.run_id) if runs else None

    def _advance(self) -> None:
        if self.progress is not None:
            self.progress.advance(1)

    def _stop_running(self) -> None:
        """The sweep is interrupted: its running trials stop with it."""
        for trial, handle in self.running.values():
            if isinstance(handle, str):
                self.jobs.cancel(handle, "the sweep was interrupted")
            else:
                handle.cancel()
            trial.state, trial.error = "failed", "the sweep was interrupted"
