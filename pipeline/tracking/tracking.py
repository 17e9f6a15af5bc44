"""MLflow tracking: one run per job, end to end (config, params, metrics, counters, model).

A run is addressed by its id, not by MLflow's process-global "active run": a cluster job's hooks
log to it from tasks on whichever workers run them over the job's life, and several jobs may log
from one worker at once. The tracking URI is the job's ``mlflow.tracking_uri`` when set, else
MLflow's own default (``sqlite:///mlflow.db`` in the working directory for MLflow 3), resolved to
what it names *here* when the job is submitted (:func:`resolved_uri`), so the workers write to
the store the person who submitted the job will look at.

A password in a URL of the job (its tracking URI, data, checkpoints, registry) never reaches a
log line, a summary, the run's params, tags or ``job.yaml`` (:func:`redact`); importing this
module stops MLflow from printing run URLs (with the password) in this process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import mlflow
import yaml
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from antdt.watch.urls import redact_all
from pipeline.job.config import JobConfig
from pipeline.tracking.uris import redact

logger = logging.getLogger(__name__)

BATCH = 500
"""Metrics or params per ``log_batch`` call (MLflow caps a batch at 1,000 metrics, 100
params)."""

_FLUENT = threading.Lock()
"""MLflow's fluent API (needed to log a model) keeps its tracking URI per process."""

# MLflow prints "View run ... at: URL" when a run ends, the URL with the tracking URI's password;
# the summary shows the run's page redacted instead
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def resolved_uri(job: JobConfig) -> str:
    """The job's tracking URI, or MLflow's default as it resolves in this process."""
    return job.mlflow.tracking_uri or mlflow.get_tracking_uri()


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists become their string form (MLflow params)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def public_config(job: JobConfig) -> dict[str, Any]:
    """The job's config as logged and shown: the password of every URL in it (tracking store,
    data, checkpoints, registry, warm start) redacted."""
    config: dict[str, Any] = redact_all(job.to_dict())
    return config


class Tracker:
    """The MLflow run of one job. :meth:`start` opens it (and logs the config), :meth:`attach`
    reaches it from another process; as a context manager it ends the run ``FINISHED``, or
    ``FAILED`` with the error as a tag when the block raises, so a broken run is never left
    ``RUNNING`` in the UI."""

    def __init__(self, tracking_uri: str, run_id: str, experiment_id: str) -> None:
        self.client = MlflowClient(tracking_uri)
        self.run_id = run_id
        self.experiment_id = experiment_id
        self._uri = tracking_uri
        self.tracking_uri = redact(tracking_uri)
        """The run's tracking URI, a password in it redacted."""
        self._pending: list[Any] = []

    @classmethod
    def start(cls, job: JobConfig, *, mode: str, tags: Mapping[str, str] | None = None,
              tracking_uri: str | None = None, experiment_id: str | None = None,
              run_name: str | None = None) -> Tracker:
        """Open a run for ``job`` in ``experiment_id`` (default: the job's experiment, made if
        missing) with its config as params and as ``job.yaml``; named ``run_name`` (default:
        the job's name and mode)."""
        uri = tracking_uri or resolved_uri(job)
        client = MlflowClient(uri)
        if experiment_id is None:
            experiment_id = experiment(uri, job.mlflow.experiment)
        run = client.create_run(experiment_id, run_name=run_name or f"{job.name}-{mode}",
                                tags=redact_all({"antdt.mode": mode, "antdt.job": job.name,
                                                 **(tags or {})}))
        tracker = cls(uri, run.info.run_id, experiment_id)
        config = public_config(job)
        params = [Param(key, str(value)[:6000]) for key, value in flatten(config).items()]
        for i in range(0, len(params), 100):
            client.log_batch(tracker.run_id, params=params[i:i + 100])
        client.log_dict(tracker.run_id, config, "job.yaml")
        logger.info("MLflow run %s in experiment %s (%s)", tracker.run_id,
                    job.mlflow.experiment, tracker.tracking_uri)
        return tracker

    @classmethod
    def reopen(cls, tracking_uri: str, run: Mapping[str, Any]) -> Tracker:
        """The run ``run`` (:meth:`info`) of a job that resumes from a checkpoint: running again
        (its end, if it had one, and the error it ended with, undone)."""
        tracker = cls.attach(tracking_uri, run)
        tracker.client.update_run(tracker.run_id, status="RUNNING")
        tags = tracker.client.get_run(tracker.run_id).data.tags
        for key in ("antdt.error", "antdt.cancelled"):
            if key in tags:
                tracker.client.delete_tag(tracker.run_id, key)
        return tracker

    def resumed(self, config: Mapping[str, Any], *, checkpoint: str, resumes: int,
                rows_replayed: int, step: int) -> None:
        """Record a resume: tags (how many, from which checkpoint), the event as metrics at the
        step where the run's series go on, and the job's config as it resumed (params are
        immutable: a changed learning rate shows here)."""
        self.client.log_batch(self.run_id, tags=[
            RunTag("antdt.resumes", str(resumes)),
            RunTag("antdt.resumed_from", redact(checkpoint))])
        self._log(self._metrics([(step, {"train.resumes": resumes,
                                         "train.rows_replayed": rows_replayed})]),
                  synchronous=True)
        self.client.log_dict(self.run_id, dict(config), f"resumes/job-{resumes}.yaml")

    @classmethod
    def attach(cls, tracking_uri: str, run: Mapping[str, Any]) -> Tracker:
        """The run ``run`` (:meth:`info`) opened elsewhere, in the store at ``tracking_uri``."""
        return cls(tracking_uri, str(run["run_id"]), str(run["experiment_id"]))

    def info(self) -> dict[str, str]:
        """The run's identity as plain data (the URI redacted): what a job's record shows."""
        return {"run_id": self.run_id, "experiment_id": self.experiment_id,
                "tracking_uri": self.tracking_uri}

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            self.end("FAILED", f"{type(exc).__name__}: {exc}")
        else:
            self.end("FINISHED")

    def end(self, status: str, reason: str | None = None) -> None:
        """End the run as ``status`` (``FINISHED``, ``FAILED``, ``KILLED``); a reason becomes
        the tag ``antdt.error`` (failed) or ``antdt.cancelled``."""
        for operation in self._pending:
            operation.wait()
        self._pending.clear()
        if reason is not None:
            self.tag("antdt.error" if status == "FAILED" else "antdt.cancelled", reason[:5000])
        self.client.set_terminated(self.run_id, status)

    # ---- metrics and tags ---------------------------------------------------------------------

    def metrics(self, values: Mapping[str, float], step: int) -> None:
        """Per-step metrics; asynchronous so a training loop never waits for the store."""
        self._log(self._metrics([(step, values)]), synchronous=False)

    def steps(self, steps: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        """Many steps' metrics at once (a cluster job's master sends them every few seconds)."""
        self._log(self._metrics(steps), synchronous=True)

    def summary(self, values: Mapping[str, float]) -> None:
        """Final values (step 0)."""
        self._log(self._metrics([(0, values)]), synchronous=True)

    def tag(self, key: str, value: str) -> None:
        """Tag the run (the password of any URL in ``value`` redacted)."""
        self.client.log_batch(self.run_id, tags=[RunTag(key, redact(value))])

    # ---- artifacts ------------------------------------------------------------------------------

    def artifact_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def artifact_yaml(self, data: Any, name: str) -> None:
        self.client.log_text(self.run_id, yaml.safe_dump(data, sort_keys=False), name)

    def artifact_file(self, path: str | Path, folder: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), folder)

    def artifact_location(self, name: str) -> str:
        """Where the run's artifact ``name`` is: its absolute path on a local artifact store,
        else its URI."""
        uri = f"{self.client.get_run(self.run_id).info.artifact_uri.rstrip('/')}/{name}"
        parts = urllib.parse.urlsplit(uri)
        if parts.scheme not in ("", "file"):
            return redact(uri)
        return os.path.abspath(urllib.parse.unquote(parts.path))

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """This run as MLflow's active run, for the fluent calls that need one (logging a
        model). The run ends with the block (``FINISHED``, or ``FAILED`` if it raises): make it
        the last thing logged. One thread at a time, since the fluent API's tracking URI is the
        process's (:func:`fluent`)."""
        with fluent(self._uri), mlflow.start_run(run_id=self.run_id):
            yield

    # ---- internals ------------------------------------------------------------------------------

    @staticmethod
    def _metrics(steps: Sequence[tuple[int, Mapping[str, float]]]) -> list[Metric]:
        now = int(time.time() * 1000)
        return [Metric(key, float(value), now, step) for step, values in steps
                for key, value in values.items()]

    def _log(self, metrics: list[Metric], synchronous: bool) -> None:
        for i in range(0, len(metrics), BATCH):
            operation = self.client.log_batch(self.run_id, metrics=metrics[i:i + BATCH],
                                              synchronous=synchronous)
            if operation is not None:
                self._pending.append(operation)


@contextlib.contextmanager
def fluent(tracking_uri: str) -> Iterator[None]:
    """``tracking_uri`` as MLflow's fluent store for the block (logging a model, resolving a
    ``models:/`` URI), one thread at a time since the fluent API's tracking URI is the
    process's; restored after (unset again if it was: MLflow's default then still follows the
    working directory)."""
    with _FLUENT:
        previous = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
        mlflow.set_tracking_uri(tracking_uri)
        try:
            yield
        finally:
            mlflow.set_tracking_uri(previous)  # type: ignore[arg-type]  # None: unset


def experiment(tracking_uri: str, name: str) -> str:
    """The id of experiment ``name`` in the store at ``tracking_uri``, made if missing (two jobs
    may race to make it). A new experiment's artifacts go where this process's MLflow puts them
    (for a local store, ``mlruns/`` in the working directory): make it where the person who
    looks at the runs works."""
    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(name))
    except MlflowException:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)
