"""MLflow tracking: one run per job, end to end (config, params, metrics, counters, model).

The tracking URI is the job's ``mlflow.tracking_uri`` when set, else MLflow's own default
(``sqlite:///mlflow.db`` in the working directory for MLflow 3), so ``antdt train`` works with
no server and with ``--tracking-uri http://host:5000`` alike.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from pathlib import Path
from types import TracebackType
from typing import Any, Mapping

import mlflow
import yaml

from pipeline.config import JobConfig

logger = logging.getLogger(__name__)


def redact(uri: str) -> str:
    """``uri`` with the password of its user part, if any, shown as ``***`` (for summaries and
    logs).

    >>> redact("http://ann:s3cret@mlflow.example:5000/"), redact("sqlite:///mlflow.db")
    ('http://ann:***@mlflow.example:5000/', 'sqlite:///mlflow.db')
    """
    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return uri
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


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


class Tracker:
    """The MLflow run of one job; use as a context manager around the whole job.

    A job that raises ends its run as ``FAILED`` with the error as a tag, so a broken run is
    never left ``RUNNING`` in the UI.
    """

    def __init__(self, job: JobConfig, *, mode: str, tags: Mapping[str, str] | None = None) -> None:
        self.job = job
        self.mode = mode
        self.tags = dict(tags or {})
        self.run_id = ""
        self.experiment_id = ""
        self.tracking_uri = ""
        """The run's tracking URI, a password in it redacted (:func:`redact`)."""

    def __enter__(self) -> Tracker:
        if self.job.mlflow.tracking_uri:
            mlflow.set_tracking_uri(self.job.mlflow.tracking_uri)
        mlflow.set_experiment(self.job.mlflow.experiment)
        run = mlflow.start_run(run_name=f"{self.job.name}-{self.mode}",
                               tags={"antdt.mode": self.mode, "antdt.job": self.job.name,
                                     **self.tags})
        self.run_id = run.info.run_id
        self.experiment_id = run.info.experiment_id
        self.tracking_uri = redact(mlflow.get_tracking_uri())
        config = self.job.to_dict()
        mlflow.log_params(flatten(config))
        mlflow.log_dict(config, "job.yaml")
        logger.info("MLflow run %s in experiment %s (%s)", self.run_id,
                    self.job.mlflow.experiment, self.tracking_uri)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            mlflow.set_tag("antdt.error", f"{type(exc).__name__}: {exc}"[:5000])
        mlflow.flush_async_logging()
        mlflow.end_run(status="FAILED" if exc is not None else "FINISHED")

    def metrics(self, values: Mapping[str, float], step: int) -> None:
        """Per-step metrics; asynchronous so the training loop never waits for the store."""
        mlflow.log_metrics(dict(values), step=step, synchronous=False)

    def summary(self, values: Mapping[str, float]) -> None:
        mlflow.log_metrics({k: float(v) for k, v in values.items()})

    def tag(self, key: str, value: str) -> None:
        mlflow.set_tag(key, value)

    def artifact_text(self, text: str, name: str) -> None:
        mlflow.log_text(text, name)

    def artifact_yaml(self, data: Any, name: str) -> None:
        mlflow.log_text(yaml.safe_dump(data, sort_keys=False), name)

    def artifact_file(self, path: str | Path, folder: str | None = None) -> None:
        mlflow.log_artifact(str(path), folder)

    def artifact_location(self, name: str) -> str:
        """Where the run's artifact ``name`` is: a path (relative to the working directory when
        it is below it) on a local artifact store, else its URI."""
        uri = mlflow.get_artifact_uri(name)
        parts = urllib.parse.urlsplit(uri)
        if parts.scheme not in ("", "file"):
            return redact(uri)
        path = urllib.parse.unquote(parts.path)
        relative = os.path.relpath(path)
        return path if relative.startswith("..") else relative
