"""The MLflow model registry: a job's model registered as a version of a named model, and the
``champion`` alias moved only by a better score on the same validation data.

Registration (``antdt train|submit --register NAME``, or ``mlflow.registered_model`` in the job
file) happens when the job's summary is known, right after the model is logged, so the version
carries the run's figures and its data window as tags::

    antdt.job, antdt.mode, antdt.workers        what ran
    antdt.auc, antdt.logloss, antdt.oracle_auc  the run's evaluation on its validation data
    antdt.rows_trained, antdt.rows_lost, antdt.rows_retrained, antdt.rows_quarantined,
    antdt.rows_replayed, antdt.samples_per_s, antdt.wall_s, antdt.train_s,
    antdt.straggler_actions                     the run's counters
    antdt.data.train, antdt.data.validation     the job's data paths (JSON lists, local paths
                                                made absolute)
    antdt.data.train_files, antdt.data.validation_files   how many Parquet files they named
    antdt.data.fingerprint                      a digest of those files (:func:`fingerprint`)

The run itself is tagged with the ``antdt.data.*`` tags when it starts (the files as they were
when training began) and with ``antdt.registered_model``/``antdt.registered_version`` when its
model is registered. Every tag stays queryable, e.g. ``search_model_versions("name = 'ranker'
and tags.`antdt.data.fingerprint` = '...'")``: how a scheduled re-run can find that a day's data
already has a version.

Promotion (:func:`promote`, ``antdt promote``) loads the candidate and the champion from the
registry as a serving system would (``models:/NAME/VERSION``), scores raw Parquet rows with
both, and moves the alias only when the candidate is better by at least ``min_gain`` and passes
the guards asked for (no worse on another metric, calibration within a tolerance; the daily
DAG asks for both). The champion it replaces keeps the alias ``champion_prev``, so a rollback
is one command (:func:`rollback`, ``antdt promote NAME --rollback``). The
decision is recorded as tags of the candidate version and of its run (the latest decision
wins)::

    antdt.promotion.decision                    first, promoted or kept
    antdt.promotion.metric, antdt.promotion.min_gain
    antdt.promotion.candidate_score, antdt.promotion.champion_score, antdt.promotion.gain
    antdt.promotion.champion_version            the champion it was compared with
    antdt.promotion.validation                  the paths scored (JSON list)
    antdt.promotion.validation_rows, antdt.promotion.validation_fingerprint
    antdt.promotion.guards, antdt.promotion.held_back   the guards' figures (JSON), and the
                                                ones that kept a better candidate out

and as the run's metrics ``promotion.candidate.<metric>``, ``promotion.champion.<metric>`` and
``promotion.gain.<metric>`` (their history keeps every decision).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import enum
import hashlib
import json
import logging
import math
import os
import queue
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlflow
import numpy as np
from fsspec.core import url_to_fs
from mlflow import MlflowClient
from mlflow.entities import Metric, RunTag
from mlflow.entities.model_registry import ModelVersion, RegisteredModel
from mlflow.exceptions import MlflowException
from mlflow.models.model import ModelInfo
from mlflow.pyfunc import PyFuncModel

from antdt.errors import AntdtError, DataError
from data.files import RowGroup, expand, open_parquet, row_groups
from data.schema import Schema
from models import evaluate
from models.train_step import TrainStep
from pipeline.job.config import DataConfig, JobConfig, check_model_name
from pipeline.job.report import JobSummary, higher_is_better
from pipeline.serving import RankingModel, log_ranking_model
from pipeline.tracking.tracking import Tracker, fluent
from pipeline.tracking.uris import redact

logger = logging.getLogger(__name__)

CHAMPION = "champion"
PREVIOUS = "champion_prev"
"""The alias of the champion a promotion replaced: :func:`rollback` makes it the champion
again."""
"""The alias of the version a serving system loads (``models:/NAME@champion``)."""

FOOTER_TAIL = 64 * 1024
"""Bytes of a file without a readable Parquet footer that stand for it in a fingerprint."""

MAX_TAG_CHARS = 8000
"""The longest run tag value MLflow stores."""


class RegistryError(AntdtError):
    """A registry call cannot be done as asked: an unknown model or version, a metric that
    cannot be computed, a version without the tags it needs (the message names it)."""


# ---- the data window --------------------------------------------------------------------------


@dataclass(frozen=True)
class DataWindow:
    """The data a run trained and validated on: the job's paths and a digest of their files."""

    train: tuple[str, ...]
    validation: tuple[str, ...]
    train_files: int
    validation_files: int
    fingerprint: str

    def tags(self) -> dict[str, str]:
        """The window as ``antdt.data.*`` tags. A path list longer than MLflow stores is left
        out, with a warning (a promotion then needs its validation paths given)."""
        return {"antdt.data.train_files": str(self.train_files),
                "antdt.data.validation_files": str(self.validation_files),
                "antdt.data.fingerprint": self.fingerprint,
                **paths_tag("antdt.data.train", self.train),
                **paths_tag("antdt.data.validation", self.validation)}


def paths_tag(key: str, paths: Sequence[str]) -> dict[str, str]:
    """``{key: paths as a JSON list}``, or nothing, with a warning, when the list is longer
    than MLflow stores in a tag (the fingerprint beside it still covers the files)."""
    value = json.dumps(list(paths))
    if len(value) > MAX_TAG_CHARS:
        logger.warning("%s: %d paths (%d characters) are too long for an MLflow tag; not "
                       "tagged", key, len(paths), len(value))
        return {}
    return {key: value}


def data_window(data: DataConfig) -> DataWindow:
    """The window of a job's ``data`` section, its files' fingerprint read now."""
    train, validation = expand(list(data.train)), expand(list(data.validation))
    return DataWindow(train=tuple(_absolute(p) for p in data.train),
                      validation=tuple(_absolute(p) for p in data.validation),
                      train_files=len(train), validation_files=len(validation),
                      fingerprint=fingerprint({"train": train, "validation": validation}))


def fingerprint(files: Mapping[str, Sequence[str]]) -> str:
    """A SHA-256 hex digest over each file's role (``train``, ``validation``), path, size and
    Parquet footer: the same files give the same digest, a rewritten file (other rows, other row
    groups) a different one, without reading any data page. A file with no readable footer (one
    a job quarantined) contributes its last :data:`FOOTER_TAIL` bytes instead."""
    digest = hashlib.sha256()
    for role in sorted(files):
        for path in files[role]:
            size, footer = _footer(path)
            digest.update(f"{role}\t{path}\t{size}\t".encode())
            digest.update(hashlib.sha256(footer).digest())
    return digest.hexdigest()


def _footer(path: str) -> tuple[int, bytes]:
    """The size of the file at ``path`` and its Parquet footer (metadata, length, magic)."""
    fs, root = url_to_fs(path)
    try:
        size = int(fs.size(root))
        with fs.open(root, "rb") as fh:
            if size >= 12:
                fh.seek(size - 8)
                end = fh.read(8)
                length = int.from_bytes(end[:4], "little")
                if end[4:] == b"PAR1" and length + 12 <= size:
                    fh.seek(size - 8 - length)
                    return size, bytes(fh.read(length + 8))
            fh.seek(max(0, size - FOOTER_TAIL))
            return size, bytes(fh.read())
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file to fingerprint it ({exc})") from exc


def _absolute(spec: str) -> str:
    """A data path as it resolves here: a URL as it is, a local path (or glob) made absolute."""
    return spec if "://" in spec else os.path.abspath(spec)


# ---- registration -----------------------------------------------------------------------------


class _Abandoned(Exception):
    """The work beside the model's logging failed: the run ends ``FAILED`` with the model."""


@contextlib.contextmanager
def logging_model(tracker: Tracker, step: TrainStep, schema: Schema, job: JobConfig, *,
                  example: RowGroup) -> Iterator[Callable[[JobSummary], JobSummary]]:
    """Log ``step``'s model to ``tracker``'s run in a thread at once, while the block does the
    run's other work (evaluating the model above all: its weights no longer change, and the
    logging is Python where the evaluation is torch's kernels). The block calls the function
    it is given with the run's summary: the model is registered when the job names a registered
    model, the run ends with it (``FAILED`` if the block, the logging or the registering
    raises) and the summary comes back naming the version. The model stays the run's last
    thing: its registration waits for the summary."""
    summaries: queue.Queue[JobSummary | None] = queue.Queue(maxsize=1)

    def log() -> JobSummary:
        with tracker.active():
            model = log_ranking_model(step, schema, job, example=example)
            summary = summaries.get()
            if summary is None:
                raise _Abandoned("the work beside logging the model failed")
            name = job.mlflow.registered_model
            if name is None:
                return summary
            version = register(tracker, model, name, summary)
        return dataclasses.replace(summary, registered_model=name, registered_version=version)

    def registered(summary: JobSummary) -> JobSummary:
        summaries.put_nowait(summary)
        return logged.result()

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="antdt-model") as pool:
        logged = pool.submit(log)
        try:
            yield registered
        except BaseException:
            with contextlib.suppress(queue.Full):
                summaries.put_nowait(None)
            with contextlib.suppress(Exception):
                logged.result()
            raise


def register(tracker: Tracker, model: ModelInfo, name: str, summary: JobSummary) -> str:
    """Make ``model`` (logged to ``tracker``'s run) a new version of ``name`` (created if
    missing), tagged with ``summary``'s figures and the run's data window; tag the run with the
    version; return the version. Needs the run's store as MLflow's fluent one
    (:meth:`Tracker.active`): the registry resolves the logged model (``models:/<id>``)
    there."""
    client = tracker.client
    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    run_tags = client.get_run(tracker.run_id).data.tags
    created = client.create_model_version(
        name, source=model.model_uri, run_id=tracker.run_id, model_id=model.model_id,
        tags=version_tags(summary, run_tags))
    return _registered_as(client, tracker.run_id, name, str(created.version))


def register_run(tracking_uri: str, run_id: str, name: str, summary: JobSummary) -> str:
    """The model that run ``run_id`` logged (``runs:/<id>/model``) as a new version of ``name``,
    tagged as :func:`register` tags one (a sweep's best trial, registered after the sweep);
    the version."""
    check_model_name(name)
    client = MlflowClient(tracking_uri)
    run_tags = client.get_run(run_id).data.tags
    with fluent(tracking_uri):
        created = mlflow.register_model(f"runs:/{run_id}/model", name,
                                        tags=version_tags(summary, run_tags))
    return _registered_as(client, run_id, name, str(created.version))


def _registered_as(client: MlflowClient, run_id: str, name: str, version: str) -> str:
    """Tag run ``run_id`` with the version its model became; the version."""
    client.log_batch(run_id, tags=[RunTag("antdt.registered_model", name),
                                   RunTag("antdt.registered_version", version)])
    logger.info("registered the model of run %s as %s version %s", run_id, name, version)
    return version


def version_tags(summary: JobSummary, run_tags: Mapping[str, str]) -> dict[str, str]:
    """A version's tags: the job's name, mode and workers, the summary's figures (those that
    are numbers, NaN left out) and the run's ``antdt.data.*`` tags and ``antdt.retrain.*`` tags
    (the scheduled retraining that trained it: :mod:`pipeline.workflows.retrain`)."""
    tags = {"antdt.job": run_tags.get("antdt.job", ""), "antdt.mode": summary.mode}
    for key, value in summary.to_dict().items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and math.isnan(value):
            continue
        tags[f"antdt.{key}"] = str(value)
    tags.update({k: v for k, v in run_tags.items()
                 if k.startswith(("antdt.data.", "antdt.retrain."))})
    return tags


# ---- promotion --------------------------------------------------------------------------------


class Outcome(enum.Enum):
    """What a promotion did."""

    FIRST = "first"
    """There was no champion: the candidate became it."""
    PROMOTED = "promoted"
    """The candidate beat the champion by at least the minimum gain and replaced it."""
    KEPT = "kept"
    """The candidate did not beat the champion by the minimum gain: the champion stays."""
    ALREADY_CHAMPION = "already champion"
    """The candidate is the champion: nothing was scored, moved or recorded."""


METRICS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "auc": evaluate.auc, "logloss": evaluate.logloss}
"""The metrics :func:`promote` compares on, by name: labels and scores -> the value."""


def gain(metric: str, candidate: float, champion: float) -> float:
    """How much better ``candidate`` scores than ``champion`` on ``metric``, whichever way the
    metric points (positive: better).

    >>> gain("auc", 0.75, 0.70) > 0, gain("logloss", 0.45, 0.50) > 0
    (True, True)
    """
    difference = candidate - champion
    return difference if higher_is_better(metric) else -difference


@dataclass(frozen=True)
class Decision:
    """The outcome of :func:`promote`: both scores on the same rows and what was done."""

    model: str
    candidate: str
    """The candidate's version."""
    champion: str | None
    """The champion's version before the decision (None: there was none)."""
    outcome: Outcome
    metric: str
    candidate_score: float | None
    champion_score: float | None
    min_gain: float
    validation: tuple[str, ...] = ()
    """The paths scored (nothing when the candidate was already the champion)."""
    rows: int = 0
    """Validation rows each model scored."""
    fingerprint: str | None = None
    """The :func:`fingerprint` of the files scored."""
    guards: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    """The other checks the promotion asked for, by name, each ``{"candidate", "champion",
    "ok"}``: a metric the candidate must be no worse at (``logloss``), and ``calibration``
    (predicted over observed click rate, within the tolerance of 1)."""
    held_back: str | None = None
    """Why a candidate better on :attr:`metric` stays out: the guards that failed."""

    @property
    def promoted(self) -> bool:
        """Whether the candidate is the champion now because of this decision."""
        return self.outcome in (Outcome.FIRST, Outcome.PROMOTED)

    @property
    def gain(self) -> float | None:
        """How much better the candidate scored than the champion (positive: better, whichever
        way the metric points); None without both scores."""
        if self.candidate_score is None or self.champion_score is None:
            return None
        return gain(self.metric, self.candidate_score, self.champion_score)

    def to_dict(self) -> dict[str, Any]:
        """The decision as plain data (``antdt promote --json``)."""
        return {**dataclasses.asdict(self), "outcome": self.outcome.value,
                "validation": list(self.validation), "gain": self.gain,
                "promoted": self.promoted}

    def lines(self) -> list[str]:
        """A short human summary: both scores, the gain, the decision."""
        if self.outcome is Outcome.ALREADY_CHAMPION:
            return [f"{self.model} version {self.candidate} is already the {CHAMPION}: "
                    "nothing to do"]
        lines = [f"{self.model}: version {self.candidate} vs {CHAMPION} "
                 + (f"version {self.champion}" if self.champion else "(none yet)")
                 + f", {self.metric} on {self.rows:,} validation rows",
                 f"  candidate  {self.candidate_score:.4f}"]
        if self.champion_score is not None and self.gain is not None:
            lines += [f"  champion   {self.champion_score:.4f}",
                      f"  gain       {self.gain:+.4f} (at least {self.min_gain:.4f} needed)"]
        for guard, found in self.guards.items():
            champion = "" if found["champion"] is None else f", champion {found['champion']:.4f}"
            lines.append(f"  {guard:<10} candidate {found['candidate']:.4f}{champion}: "
                         f"{'ok' if found['ok'] else 'failed'}")
        verdict = {Outcome.FIRST: f"promoted: no {CHAMPION} yet, version {self.candidate} is it",
                   Outcome.PROMOTED: f"promoted: version {self.candidate} is the {CHAMPION}",
                   Outcome.KEPT: f"kept: version {self.champion} stays the {CHAMPION}"
                   + (f" (held back: {self.held_back})" if self.held_back else "")}
        return [*lines, f"  decision   {verdict[self.outcome]}"]

    def tags(self) -> dict[str, str]:
        """The decision as ``antdt.promotion.*`` tags (of the candidate version and its run)."""
        tags = {"antdt.promotion.decision": self.outcome.value,
                "antdt.promotion.metric": self.metric,
                "antdt.promotion.candidate_score": str(self.candidate_score),
                "antdt.promotion.min_gain": str(self.min_gain),
                "antdt.promotion.validation_rows": str(self.rows),
                "antdt.promotion.validation_fingerprint": str(self.fingerprint),
                **paths_tag("antdt.promotion.validation", self.validation)}
        if self.guards:
            tags["antdt.promotion.guards"] = json.dumps(self.guards, sort_keys=True)
        if self.held_back:
            tags["antdt.promotion.held_back"] = self.held_back
        if self.champion is not None:
            tags.update({"antdt.promotion.champion_version": self.champion,
                         "antdt.promotion.champion_score": str(self.champion_score),
                         "antdt.promotion.gain": str(self.gain)})
        return tags

    @classmethod
    def from_tags(cls, model: str, version: str, tags: Mapping[str, str]) -> Decision | None:
        """The decision :meth:`tags` recorded on ``model`` version ``version`` (None: no
        decision among ``tags``)."""
        if "antdt.promotion.decision" not in tags:
            return None

        def value(key: str) -> str | None:
            found = tags.get(f"antdt.promotion.{key}")
            return None if found in (None, "None") else found

        def score(key: str) -> float | None:
            found = value(key)
            return None if found is None else float(found)

        return cls(model, version, value("champion_version"),
                   Outcome(tags["antdt.promotion.decision"]), tags["antdt.promotion.metric"],
                   score("candidate_score"), score("champion_score"),
                   float(tags["antdt.promotion.min_gain"]),
                   tuple(json.loads(tags.get("antdt.promotion.validation", "[]"))),
                   int(tags.get("antdt.promotion.validation_rows", "0")),
                   value("validation_fingerprint"),
                   json.loads(tags.get("antdt.promotion.guards", "{}")), value("held_back"))

    def metrics(self) -> dict[str, float]:
        """Both scores and the gain as the run's ``promotion.*`` metrics."""
        values = {f"promotion.candidate.{self.metric}": self.candidate_score,
                  f"promotion.champion.{self.metric}": self.champion_score,
                  f"promotion.gain.{self.metric}": self.gain}
        return {k: float(v) for k, v in values.items() if v is not None}


def promote(name: str, *, version: int | None = None, metric: str = "auc",
            on: str | Sequence[str] | None = None, min_gain: float = 0.0,
            tracking_uri: str | None = None, no_worse: Sequence[str] = (),
            calibration: float | None = None) -> Decision:
    """Score version ``version`` of ``name`` (default: the newest) and the ``champion`` on the
    same validation data, ``on`` (Parquet files, folders or globs; default: the candidate's
    ``antdt.data.validation`` tag); make the candidate the champion when there is none, or when
    it is better on ``metric`` (``auc``: higher, ``logloss``: lower) by at least ``min_gain``
    (a tie keeps the champion), no worse on each of ``no_worse`` and, with ``calibration``, its
    mean prediction within that share of the observed click rate. The replaced champion keeps
    the alias ``champion_prev`` (:func:`rollback`). The decision is recorded (module docstring)
    unless the candidate already is the champion, which is a no-op."""
    for asked in (metric, *no_worse):
        if asked not in METRICS:
            raise RegistryError(f"metric {asked!r}: expected one of {', '.join(METRICS)}")
    if not math.isfinite(min_gain) or min_gain < 0:
        raise RegistryError(f"min_gain {min_gain}: expected a finite number >= 0")
    uri = tracking_uri or mlflow.get_tracking_uri()
    client = MlflowClient(uri)
    aliases = _registered(client, name, uri).aliases
    candidate = _version(client, name, version)
    champion = str(aliases[CHAMPION]) if CHAMPION in aliases else None
    if champion == str(candidate.version):
        logger.info("%s version %s is already the champion", name, champion)
        return Decision(name, champion, champion, Outcome.ALREADY_CHAMPION, metric,
                        None, None, min_gain)
    paths = ((on,) if isinstance(on, str) else tuple(on)) if on else _validation_paths(candidate)
    files = expand(list(paths))
    versions = [str(candidate.version)] + ([champion] if champion is not None else [])
    labels, scores = score_versions(name, versions, files, uri)
    values = [_metric(metric, labels, s, name, v, paths) for v, s in zip(versions, scores)]
    candidate_score, champion_score = values[0], (values[1] if champion is not None else None)
    checks = _guards(labels, scores, no_worse, calibration, name, versions, paths)
    outcome, held_back = Outcome.FIRST, None
    if champion_score is not None:
        better = gain(metric, candidate_score, champion_score)
        failed = [guard for guard, found in checks.items() if not found["ok"]]
        outcome = Outcome.PROMOTED if better > 0 and better >= min_gain and not failed \
            else Outcome.KEPT
        held_back = ", ".join(failed) if failed and better > 0 and better >= min_gain else None
    decision = Decision(name, str(candidate.version), champion, outcome, metric,
                        candidate_score, champion_score, min_gain, paths, len(labels),
                        fingerprint({"validation": files}), checks, held_back)
    if decision.promoted:
        client.set_registered_model_alias(name, CHAMPION, str(candidate.version))
        if champion is not None:
            client.set_registered_model_alias(name, PREVIOUS, champion)
    _record(client, candidate, decision)
    logger.info("promotion of %s version %s against %s: %s (%s %s vs %s on %d rows)", name,
                candidate.version, champion, outcome.value, metric, candidate_score,
                champion_score, len(labels))
    return decision


def _guards(labels: np.ndarray, scores: Sequence[np.ndarray], no_worse: Sequence[str],
            calibration: float | None, name: str, versions: Sequence[str],
            paths: Sequence[str]) -> dict[str, dict[str, Any]]:
    """:attr:`Decision.guards` of the candidate (``scores[0]``) against the champion (the
    other, if any)."""
    checks: dict[str, dict[str, Any]] = {}
    for guard in no_worse:
        found = [_metric(guard, labels, s, name, v, paths) for v, s in zip(versions, scores)]
        champion = found[1] if len(found) > 1 else None
        checks[guard] = {"candidate": found[0], "champion": champion,
                         "ok": champion is None or gain(guard, found[0], champion) >= 0}
    if calibration is not None:
        ratios = [float(s.mean() / max(labels.mean(), 1e-12)) for s in scores]
        checks["calibration"] = {"candidate": ratios[0],
                                 "champion": ratios[1] if len(ratios) > 1 else None,
                                 "ok": abs(ratios[0] - 1) <= calibration}
    return checks


def rollback(name: str, tracking_uri: str | None = None) -> tuple[str, str]:
    """Make the version ``champion_prev`` names the champion again, and the champion it
    replaces ``champion_prev`` (a second rollback undoes the first); ``(from, to)``."""
    uri = tracking_uri or mlflow.get_tracking_uri()
    client = MlflowClient(uri)
    aliases = _registered(client, name, uri).aliases
    if CHAMPION not in aliases or PREVIOUS not in aliases:
        raise RegistryError(f"{name} has no {PREVIOUS} to roll back to (a promotion that "
                            f"replaces a {CHAMPION} keeps it); aliases: {dict(aliases)}")
    current, previous = str(aliases[CHAMPION]), str(aliases[PREVIOUS])
    client.set_registered_model_alias(name, CHAMPION, previous)
    client.set_registered_model_alias(name, PREVIOUS, current)
    client.set_model_version_tag(name, current, "antdt.promotion.rolled_back_to", previous)
    logger.info("rolled %s back from version %s to version %s", name, current, previous)
    return current, previous


def recorded_decision(name: str, version: str, tracking_uri: str) -> Decision | None:
    """The latest promotion decision recorded on version ``version`` of ``name``, None when it
    was never judged."""
    tags = MlflowClient(tracking_uri).get_model_version(name, version).tags
    return Decision.from_tags(name, str(version), tags)


def score_versions(name: str, versions: Sequence[str], files: Sequence[str], tracking_uri: str
                   ) -> tuple[np.ndarray, list[np.ndarray]]:
    """The labels of every row of ``files`` (n,) and each version's click probabilities (n,),
    the versions loaded from the registry (``models:/NAME/VERSION``) and fed raw rows read
    with pyarrow, one row group at a time, as pandas frames without the label."""
    with fluent(tracking_uri):
        models = [mlflow.pyfunc.load_model(f"models:/{name}/{v}") for v in versions]
    found = {v: _label(model, name, v) for v, model in zip(versions, models)}
    label = found[versions[0]]
    if set(found.values()) != {label}:
        raise RegistryError(f"{name}: the versions' schemas name different labels {found}; "
                            "expected one label column to score them against")
    labels: list[np.ndarray] = []
    scores: list[list[np.ndarray]] = [[] for _ in models]
    for group in row_groups(files):
        with open_parquet(group.path) as parquet:
            frame = parquet.read_row_group(group.index).to_pandas()
        if label not in frame.columns or frame[label].isna().any():
            raise DataError(f"{group.path} row group {group.index}: expected a label column "
                            f"{label!r} without nulls to score against")
        labels.append(frame.pop(label).to_numpy(np.float64))
        for model, out in zip(models, scores):
            out.append(np.asarray(model.predict(frame), dtype=np.float64))
    return np.concatenate(labels), [np.concatenate(s) for s in scores]


def _label(model: PyFuncModel, name: str, version: str) -> str:
    """The label column of the schema ``model`` was trained on."""
    python_model = model.unwrap_python_model()
    if not isinstance(python_model, RankingModel):
        raise RegistryError(f"{name} version {version}: expected an antdt ranking model, "
                            f"found {type(python_model).__name__}")
    return python_model.schema.label


def _metric(metric: str, labels: np.ndarray, scores: np.ndarray, name: str, version: str,
            paths: Sequence[str]) -> float:
    value = METRICS[metric](labels, scores)
    if not math.isfinite(value):
        raise RegistryError(f"cannot compute {metric} of {name} version {version} on "
                            f"{list(paths)} ({len(labels):,} rows): found {value} (an AUC needs "
                            "both clicks and non-clicks)")
    return value


def _registered(client: MlflowClient, name: str, uri: str) -> RegisteredModel:
    """The registered model ``name``, or an error listing the ones there are."""
    try:
        return client.get_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    known = sorted(m.name for m in client.search_registered_models(max_results=20))
    raise RegistryError(f"no registered model {name!r} in {redact(uri)}; found "
                        f"{known or 'none'}")


def _version(client: MlflowClient, name: str, version: int | None) -> ModelVersion:
    """Version ``version`` of ``name`` (None: the newest), or an error listing the versions."""
    versions = client.search_model_versions(f"name = '{name}'")
    numbers = sorted(int(v.version) for v in versions)
    if not numbers:
        raise RegistryError(f"registered model {name!r} has no versions to promote")
    wanted = numbers[-1] if version is None else version
    if wanted not in numbers:
        raise RegistryError(f"registered model {name!r} has no version {version}; found "
                            f"versions {numbers}")
    return client.get_model_version(name, str(wanted))


def _validation_paths(version: ModelVersion) -> tuple[str, ...]:
    raw = version.tags.get("antdt.data.validation")
    if raw is None:
        raise RegistryError(f"{version.name} version {version.version} has no "
                            "antdt.data.validation tag: give the validation data to score on "
                            "(--on PATHS)")
    return tuple(json.loads(raw))


def _record(client: MlflowClient, candidate: ModelVersion, decision: Decision) -> None:
    """The decision as tags of the candidate version and of its run, and as the run's metrics
    (a version registered without a run gets the tags only)."""
    tags = decision.tags()
    for key, value in tags.items():
        client.set_model_version_tag(decision.model, str(candidate.version), key, value)
    if not candidate.run_id:
        return
    now = int(time.time() * 1000)
    client.log_batch(candidate.run_id,
                     metrics=[Metric(k, v, now, 0) for k, v in decision.metrics().items()],
                     tags=[RunTag(k, v) for k, v in tags.items()])
