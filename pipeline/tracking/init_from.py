"""Where ``train.init_from`` points, found where the job is submitted (MLflow is reached here,
never on a worker), and checked against the job's model before anything starts
(:func:`models.warm.plan`).

A source is named as

- ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``: a registered model's version (the
  champion: ``models:/ranking@champion``);
- ``runs:/RUN_ID``: the model a run logged, or the parts a run's job wrote (tag
  ``antdt.model_dir``);
- a folder: a checkpoint (one version, or a job's checkpoint folder: its newest good version), a
  logged model's folder (``MLmodel``), or a model in parts (``model-dense.pt`` and the ranks'
  files).

The workers read the source where it is, so it must be reachable from them: a local path on the
machine (or shared storage), or an fsspec URL (``s3://...``). A model whose artifacts MLflow
serves itself (``mlflow-artifacts:``) is downloaded once into ``~/.cache/antdt/init/`` first,
which a cluster on this machine reads. What the job's run records of its start:
:attr:`Located.tags`.
"""

from __future__ import annotations

import logging
import posixpath
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import yaml
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from antdt.errors import CheckpointError, ConfigError
from antdt.jobs import checkpoints
from data.schema import Schema
from models.shards import DENSE
from models.warm import (STATE_FILE, WEIGHTS_FILE, Layout, WarmStart, has_train_state, job_shapes,
                         plan, source_shapes)
from pipeline.job.config import JobConfig

logger = logging.getLogger(__name__)

CACHE = Path("~/.cache/antdt/init").expanduser()
"""Where a model MLflow serves itself is downloaded for the workers to read."""

TAG = "antdt.init_from"
"""The run's tag naming what it started from; ``antdt.init_from.*`` say more (version, run,
checkpoint, what a partial start left)."""

_READABLE = {"", "file", "s3", "s3a", "gs", "gcs", "abfs", "az", "hdfs", "memory"}


@dataclass(frozen=True)
class Located:
    """A source's files (see :class:`models.warm.WarmStart`), its optimisers' kinds where
    known, and the tags the job's run records."""

    layout: Layout
    folder: str
    files: dict[str, Any] = field(default_factory=dict)
    optimizers: tuple[str | None, str | None] = (None, None)
    tags: dict[str, str] = field(default_factory=dict)


def warm_start(job: JobConfig, schema: Schema, tracking_uri: str,
               say: Callable[[str], None] = logger.warning
               ) -> tuple[WarmStart | None, dict[str, str]]:
    """``job``'s :class:`WarmStart` (None without ``train.init_from``), checked against its
    model, and the tags its run records; ``say`` tells what a partial start left at its
    initial values."""
    ref = job.train.init_from
    if ref is None:
        return None, {}
    found = locate(ref, tracking_uri)
    shapes = source_shapes(found.layout, found.folder, found.files, found.optimizers)
    warm = plan(ref, found.layout, found.folder, found.files, shapes,
                job_shapes(schema, job.model, job.train.optim),
                partial=job.train.init_from_partial,
                with_train_state=found.layout != "logged" or has_train_state(found.folder))
    tags = dict(found.tags)
    if warm.left:
        say(f"train.init_from {ref}: left at their initial values: {', '.join(warm.left)}")
        tags[f"{TAG}.left"] = "; ".join(warm.left)[:5000]
    return warm, tags


def locate(ref: str, tracking_uri: str) -> Located:
    """The files ``ref`` names (see the module docstring); :class:`ConfigError` naming ``ref``
    and what was expected when there are none."""
    try:
        if ref.startswith("models:/"):
            return _registered(ref, MlflowClient(tracking_uri))
        if ref.startswith("runs:/"):
            return _run(ref, MlflowClient(tracking_uri))
    except MlflowException as exc:
        raise ConfigError(f"train.init_from {ref}: {exc.message}") from exc
    return _folder(ref)


def _registered(ref: str, client: MlflowClient) -> Located:
    name, at, alias = ref.removeprefix("models:/").partition("@")
    if at:
        version = client.get_model_version_by_alias(name, alias)
    else:
        name, _, number = name.rpartition("/")
        if not name or not number.isdigit():
            raise ConfigError(f"train.init_from {ref}: expected models:/NAME@ALIAS or "
                              "models:/NAME/VERSION")
        version = client.get_model_version(name, number)
    if not version.run_id:
        raise ConfigError(f"train.init_from {ref}: version {version.version} of {name} names "
                          "no run that logged it; give the model's run (runs:/RUN_ID)")
    found = _run_model(client, version.run_id, version.model_id, ref)
    found.tags.update({f"{TAG}.model": name, f"{TAG}.version": str(version.version)})
    return found


def _run(ref: str, client: MlflowClient) -> Located:
    run_id = ref.removeprefix("runs:/").strip("/").partition("/")[0]
    if not run_id:
        raise ConfigError(f"train.init_from {ref}: expected runs:/RUN_ID")
    return _run_model(client, run_id, None, ref)


def _run_model(client: MlflowClient, run_id: str, model_id: str | None, ref: str) -> Located:
    """The model run ``run_id`` left: the logged model ``model_id`` (or its one logged model),
    or the parts its job wrote."""
    run = client.get_run(run_id)
    params = run.data.params
    optimizers = (params.get("train.sparse_optimizer"), params.get("train.dense_optimizer"))
    tags = {TAG: ref, f"{TAG}.run_id": run_id}
    if model_id is None and "antdt.model_dir" in run.data.tags:
        cache = _cache(f"parts-{run_id}")
        client.download_artifacts(run_id, "model_parts.yaml", str(cache))
        listed = yaml.safe_load((cache / "model_parts.yaml").read_text())
        return Located("parts", str(listed["folder"]), dict(listed["files"]), optimizers, tags)
    if model_id is None:
        models = client.search_logged_models([run.info.experiment_id],
                                             filter_string=f"source_run_id = '{run_id}'")
        if not models:
            raise ConfigError(f"train.init_from {ref}: run {run_id} logged no model and wrote "
                              "none in parts")
        model_id = models[0].model_id
    folder = _readable(client.get_logged_model(model_id).artifact_location, model_id)
    return Located("logged", folder, {}, _spec_optimizers(posixpath.join(folder, "spec.yaml")),
                   tags)


def _readable(location: str, model_id: str) -> str:
    """The logged model's ``artifacts`` folder as the workers read it: where it is, or its
    copy in :data:`CACHE` when MLflow serves it itself."""
    scheme = urllib.parse.urlsplit(location).scheme
    if scheme in _READABLE or len(scheme) == 1:  # a Windows drive reads as a scheme
        folder = location.removeprefix("file://") if scheme == "file" else location
        return posixpath.join(folder, "artifacts")
    import mlflow.artifacts

    target = _cache(model_id)
    if not (target / "artifacts" / WEIGHTS_FILE).exists():
        mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{model_id}",
                                            dst_path=str(target))
    return str(target / "artifacts")


def _cache(name: str) -> Path:
    folder = CACHE / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _folder(ref: str) -> Located:
    """A folder: a logged model, a model in parts, or a checkpoint."""
    fs, path = fsspec.core.url_to_fs(ref)
    folder = ref.rstrip("/")
    tags = {TAG: ref}
    if fs.exists(posixpath.join(path, "MLmodel")):
        return Located("logged", posixpath.join(folder, "artifacts"), {}, _spec_optimizers(
            posixpath.join(folder, "artifacts", "spec.yaml")), tags)
    if fs.exists(posixpath.join(path, DENSE)):
        names = [posixpath.basename(p) for p in fs.ls(path, detail=False)]
        return Located("parts", folder, {n: {} for n in names if n.endswith((".bin", ".pt"))},
                       (None, None), tags)
    try:
        manifest = checkpoints.resolve(folder, None, logger.warning)
    except CheckpointError as exc:
        raise ConfigError(f"train.init_from {ref}: not a model: expected a registry model "
                          "(models:/NAME@ALIAS), a run (runs:/RUN_ID), a checkpoint, a logged "
                          f"model's folder or a model in parts ({exc})") from exc
    fixed = manifest.fingerprint
    optimizers = (fixed.get("train.sparse_optimizer"), fixed.get("train.dense_optimizer"))
    tags[f"{TAG}.checkpoint"] = manifest.path
    if checkpoints.MODEL in manifest.files:
        return Located("state", manifest.path, {STATE_FILE: manifest.files[STATE_FILE]},
                       optimizers, tags)
    return Located("parts", manifest.path, checkpoints.model_files(manifest), optimizers, tags)


def _spec_optimizers(path: str) -> tuple[str | None, str | None]:
    """The optimisers a logged model's ``spec.yaml`` names."""
    with fsspec.open(path, "r") as f:
        optim = (yaml.safe_load(f) or {}).get("optim") or {}
    return optim.get("sparse_optimizer"), optim.get("dense_optimizer")
