"""The job config: one YAML file in, one validated, typed :class:`JobConfig` out.

::

    data:
      train: demo-data/synthetic/date=2026-11-0[1-6]   # paths, globs or fsspec URLs (str or list)
      validation: demo-data/synthetic/date=2026-11-07
      schema: demo-data/synthetic/schema.yaml
      on_bad_data: fail            # or quarantine: skip bad row groups, report their rows
    model: {arch: dlrm, embedding_dim: 16}
    train: {batch_size: 4096, epochs: 1, seed: 0, sparse_lr: 0.05, dense_lr: 0.001,
            mode: async, workers: 2, sync_period: 4 peer batches, shard_rows: 32768,
            sharding: antdt}
    mlflow: {experiment: antdt, tracking_uri: null}
    faults:                        # injected faults (tests, benchmarks); none by default
      - {worker: 1, slowdown: 3.0}             # worker 1 takes 3x as long per batch
      - {worker: 0, crash_after_rows: 50000}   # worker 0's process exits after 50k rows
      - {worker: 2, slowdown: 4, slow_for_rows: 100000}  # 4x slower for its first 100k rows
      - {worker: 3, pause_after_rows: 8192, pause_until: go}  # then waits for Dask Event "go"

``train.mode``: ``async`` (default) trains on a Dask cluster, one replica per worker with
background model sync; ``sync`` trains one model whose tables are sharded across the workers,
in synchronous steps (for dedicated clusters, and for tables larger than one worker), each
worker's local batch sized by its speed unless ``train.adaptive_batch: false`` (equal
local batches); ``batch_size`` is the global batch either way, the rows of one optimizer step
as in every mode, so the job trains as one process would, however many workers; ``local``
trains in this process. ``train.sync_period`` (async mode) is
how often a worker starts a sync round: batches of its peers (default ``4 peer batches``: a
round every ``4 // (workers - 1)`` of its own batches, at least one, so that a replica trains on
about 4 of its peers' batches before it applies them, however many workers), its own batches
(``1 batch``: the same staleness on a slow machine as on a fast one) or seconds (``0.5``,
``500ms``: a bounded share of the CPU).
``train.shard_rows`` defaults to 8 x ``batch_size``. ``train.sharding`` (async mode): ``antdt`` (default) leases shards dynamically
and runs the straggler controller; ``pull`` leases dynamically without the controller; ``static``
deals each worker a fixed 1/N of the shards up front (the baselines of ``antdt bench
stragglers``). A fault's ``worker`` is the index of a worker in the job's sorted initial
worker list; ``hang_after_rows``/``crash_after_rows`` count the rows that worker trained.

Relative local paths are read from the current working directory. Unknown keys are rejected
with the key's full name, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml

from antdt.errors import CheckpointError, ConfigError
from antdt.jobs.checkpoints import Every
from antdt.sync import DEFAULT_PERIOD, SyncPeriod
from data.schema import read_yaml
from models.config import ModelConfig, OptimConfig

OnBadData = Literal["fail", "quarantine"]
Mode = Literal["async", "sync", "local"]
MODES: tuple[Mode, ...] = ("async", "sync", "local")
Sharding = Literal["antdt", "pull", "static"]
SHARDINGS: tuple[Sharding, ...] = ("antdt", "pull", "static")
SHARD_BATCHES = 8
"""Default ``train.shard_rows``: this many batches."""
_OPTIM_KEYS = {f.name for f in dataclasses.fields(OptimConfig)}


@dataclass(frozen=True)
class DataConfig:
    train: tuple[str, ...]
    validation: tuple[str, ...]
    schema: str
    on_bad_data: OnBadData = "fail"


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 4096
    epochs: int = 1
    seed: int = 0
    threads: int = 1
    log_every: int = 50
    mode: Mode = "async"
    adaptive_batch: bool = True
    """Sync mode: the controller sizes each worker's local batch by its speed (false: equal)."""
    workers: int = 2
    min_batches_per_worker: int = 128
    """The async mode trains on fewer workers than ``workers`` when each would see fewer
    batches than this (0: never): a replica that syncs only a few dozen times drifts from the
    others (see :meth:`antdt.jobs.JobPlan.fitted_workers`)."""
    sync_period: SyncPeriod = DEFAULT_PERIOD
    shard_rows: int = SHARD_BATCHES * 4096
    sharding: Sharding = "antdt"
    checkpoint_dir: str | None = None
    """Where the job's checkpoints go (a local path or an fsspec URL; None: no checkpoints)."""
    checkpoint_every: str = "60s"
    """Rows trained between checkpoints, or a duration such as ``60s``."""
    checkpoint_keep: int = 3
    init_from: str | None = None
    """The model the job starts from (:mod:`pipeline.tracking.init_from`): a registry model
    (``models:/ranking@champion``, ``models:/ranking/7``), a run's (``runs:/<id>``), a
    checkpoint or a model folder; None: the seed's initial model."""
    init_from_partial: bool = False
    """Take the tables and layers of ``init_from`` whose shapes match and leave the rest at
    their initial values (false: a model that does not fit the job refuses it)."""
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass(frozen=True)
class FaultConfig:
    """Faults injected into the agent of worker number ``worker`` (:class:`antdt.agent.Faults`)."""

    worker: int
    slowdown: float = 1.0
    hang_after_rows: int | None = None
    crash_after_rows: int | None = None
    slow_for_rows: int | None = None
    pause_until: str | None = None
    pause_after_rows: int = 0


@dataclass(frozen=True)
class MlflowConfig:
    experiment: str = "antdt"
    tracking_uri: str | None = None
    registered_model: str | None = None


@dataclass(frozen=True)
class JobConfig:
    name: str
    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    mlflow: MlflowConfig
    faults: tuple[FaultConfig, ...] = ()
    source: str = "<job>"

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (what is logged to MLflow and written back as YAML)."""
        train = {k: v for k, v in dataclasses.asdict(self.train).items() if k != "optim"}
        train["sync_period"] = str(self.train.sync_period)
        train.update(self.train.optim.to_dict())
        return {
            "name": self.name,
            "data": {"train": list(self.data.train), "validation": list(self.data.validation),
                     "schema": self.data.schema, "on_bad_data": self.data.on_bad_data},
            "model": self.model.to_dict(),
            "train": train,
            "mlflow": dataclasses.asdict(self.mlflow),
            "faults": [dataclasses.asdict(f) for f in self.faults],
        }


def load_job(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Read a job YAML, apply ``key.sub=value`` overrides (values parsed as YAML), validate."""
    raw = read_yaml(path, "job file")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, found {type(raw).__name__}")
    for item in overrides:
        apply_override(raw, item)
    default_name = Path(str(path)).stem
    return job_from_dict(raw, source=str(path), default_name=default_name)


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` in a nested dict in place; the value is parsed as YAML."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set expects key.path=value, found {item!r}")
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section (it holds {child!r})")
        node = child
    node[parts[-1]] = yaml.safe_load(text)


def job_from_dict(raw: Mapping[str, Any], source: str = "<job>",
                  default_name: str = "job") -> JobConfig:
    _reject_unknown(raw, {"name", "data", "model", "train", "mlflow", "faults"}, source)
    if "data" not in raw:
        raise ConfigError(f"{source}: missing section 'data' (train, validation, schema)")
    name = raw.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{source}: 'name' must be a non-empty string, found {name!r}")
    return JobConfig(
        name=name,
        data=_data(_section(raw, "data", source), f"{source}: data"),
        model=ModelConfig.from_dict(_section(raw, "model", source), where=f"{source}: model"),
        train=_train(_section(raw, "train", source), f"{source}: train"),
        mlflow=_mlflow(_section(raw, "mlflow", source), f"{source}: mlflow"),
        faults=_faults(raw.get("faults"), f"{source}: faults"),
        source=source,
    )


def _section(raw: Mapping[str, Any], key: str, source: str) -> Mapping[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: section {key!r} must be a mapping, found {value!r}")
    return value


def _reject_unknown(raw: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; expected only {sorted(allowed)}")


def _paths(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str) and value:
        return (value,)
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise ConfigError(f"{where}: expected a path, glob or URL (or a list of them), found {value!r}")


def _data(raw: Mapping[str, Any], where: str) -> DataConfig:
    _reject_unknown(raw, {"train", "validation", "schema", "on_bad_data"}, where)
    for key in ("train", "validation", "schema"):
        if key not in raw:
            raise ConfigError(f"{where}: missing key {key!r}")
    schema = raw["schema"]
    if not isinstance(schema, str) or not schema:
        raise ConfigError(f"{where}.schema: expected the path of a schema YAML, found {schema!r}")
    on_bad = raw.get("on_bad_data", "fail")
    if on_bad not in ("fail", "quarantine"):
        raise ConfigError(f"{where}.on_bad_data: expected 'fail' or 'quarantine', found {on_bad!r}")
    return DataConfig(train=_paths(raw["train"], f"{where}.train"),
                      validation=_paths(raw["validation"], f"{where}.validation"),
                      schema=schema, on_bad_data=on_bad)


def _positive_int(raw: Mapping[str, Any], key: str, default: int, where: str,
                  minimum: int = 1) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}.{key}: expected an integer >= {minimum}, found {value!r}")
    return value


def _number(raw: Mapping[str, Any], key: str, default: float, where: str, *,
            minimum: float, inclusive: bool = True) -> float:
    value = raw.get(key, default)
    bound = f">= {minimum}" if inclusive else f"> {minimum}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value in (float("inf"), float("-inf")) \
            or (value < minimum if inclusive else value <= minimum):
        raise ConfigError(f"{where}.{key}: expected a finite number {bound}, found {value!r}")
    return float(value)


def _train(raw: Mapping[str, Any], where: str) -> TrainConfig:
    own = {"batch_size", "epochs", "seed", "threads", "log_every", "mode", "adaptive_batch",
           "workers",
           "min_batches_per_worker", "sync_period", "shard_rows", "sharding", "checkpoint_dir", "checkpoint_every",
           "checkpoint_keep", "init_from", "init_from_partial"}
    _reject_unknown(raw, own | _OPTIM_KEYS, where)
    defaults = TrainConfig()
    optim = OptimConfig.from_dict({k: v for k, v in raw.items() if k in _OPTIM_KEYS}, where=where)
    mode = raw.get("mode", defaults.mode)
    if mode not in MODES:
        raise ConfigError(f"{where}.mode: expected one of {list(MODES)}, found {mode!r}")
    adaptive = raw.get("adaptive_batch", defaults.adaptive_batch)
    if not isinstance(adaptive, bool):
        raise ConfigError(f"{where}.adaptive_batch: expected true or false, found {adaptive!r}")
    sharding = raw.get("sharding", defaults.sharding)
    if sharding not in SHARDINGS:
        raise ConfigError(f"{where}.sharding: expected one of {list(SHARDINGS)}, found "
                          f"{sharding!r}")
    batch_size = _positive_int(raw, "batch_size", defaults.batch_size, where)
    from antdt.sharding.dealing import MAX_EPOCHS, MAX_ROWS  # the ledger's bounds
    for key, most in (("batch_size", MAX_ROWS), ("shard_rows", MAX_ROWS),
                      ("epochs", MAX_EPOCHS), ("threads", 1024), ("workers", 100_000),
                      ("checkpoint_keep", 10_000)):
        value = raw.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > most:
            raise ConfigError(f"{where}.{key}: expected an integer <= {most:,}, found {value:,}")
    checkpoint_dir = raw.get("checkpoint_dir")
    if checkpoint_dir is not None and (not isinstance(checkpoint_dir, str) or not checkpoint_dir):
        raise ConfigError(f"{where}.checkpoint_dir: expected a path or fsspec URL, found "
                          f"{checkpoint_dir!r}")
    init_from = raw.get("init_from")
    if init_from is not None and (not isinstance(init_from, str) or not init_from):
        raise ConfigError(f"{where}.init_from: expected models:/NAME@ALIAS, models:/NAME/VERSION, "
                          f"runs:/RUN_ID or a folder, found {init_from!r}")
    partial = raw.get("init_from_partial", defaults.init_from_partial)
    if not isinstance(partial, bool):
        raise ConfigError(f"{where}.init_from_partial: expected true or false, found {partial!r}")
    try:
        every = Every.parse(raw.get("checkpoint_every", defaults.checkpoint_every),
                            where=f"{where}.checkpoint_every")
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from exc
    return TrainConfig(
        batch_size=batch_size,
        epochs=_positive_int(raw, "epochs", defaults.epochs, where),
        seed=_positive_int(raw, "seed", defaults.seed, where, minimum=0),
        threads=_positive_int(raw, "threads", defaults.threads, where),
        log_every=_positive_int(raw, "log_every", defaults.log_every, where),
        mode=mode,
        adaptive_batch=adaptive,
        workers=_positive_int(raw, "workers", defaults.workers, where),
        min_batches_per_worker=_positive_int(raw, "min_batches_per_worker",
                                             defaults.min_batches_per_worker, where, minimum=0),
        sync_period=(SyncPeriod.parse(raw["sync_period"], where=f"{where}.sync_period")
                     if "sync_period" in raw else defaults.sync_period),
        shard_rows=_positive_int(raw, "shard_rows", SHARD_BATCHES * batch_size, where),
        sharding=sharding,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=str(every),
        checkpoint_keep=_positive_int(raw, "checkpoint_keep", defaults.checkpoint_keep, where),
        init_from=init_from,
        init_from_partial=partial,
        optim=optim,
    )


def _faults(raw: Any, where: str) -> tuple[FaultConfig, ...]:
    """The ``faults`` list: one entry per worker index, each naming at least one fault."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected a list of {{worker, slowdown, hang_after_rows, "
                          f"crash_after_rows, slow_for_rows, pause_until, pause_after_rows}}, "
                          f"found {raw!r}")
    faults: list[FaultConfig] = []
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{at}: expected a mapping, found {item!r}")
        _reject_unknown(item, {"worker", "slowdown", "hang_after_rows", "crash_after_rows",
                               "slow_for_rows", "pause_until", "pause_after_rows"}, at)
        if "worker" not in item:
            raise ConfigError(f"{at}: missing key 'worker' (the index of the worker to fault)")
        worker = _positive_int(item, "worker", 0, at, minimum=0)
        if any(f.worker == worker for f in faults):
            raise ConfigError(f"{at}: worker {worker} already has a faults entry; merge them")
        rows = {key: _positive_int(item, key, 0, at, minimum=0) if item.get(key) is not None
                else None for key in ("hang_after_rows", "crash_after_rows", "slow_for_rows")}
        pause_until = item.get("pause_until")
        if pause_until is not None and (not isinstance(pause_until, str) or not pause_until):
            raise ConfigError(f"{at}.pause_until: expected the name of a Dask Event, found "
                              f"{pause_until!r}")
        fault = FaultConfig(worker=worker,
                            slowdown=_number(item, "slowdown", 1.0, at, minimum=1.0), **rows,
                            pause_until=pause_until,
                            pause_after_rows=_positive_int(item, "pause_after_rows", 0, at,
                                                           minimum=0))
        if fault.slowdown == 1.0 and rows["hang_after_rows"] is None \
                and rows["crash_after_rows"] is None and pause_until is None:
            raise ConfigError(f"{at}: expected at least one of slowdown > 1, hang_after_rows, "
                              f"crash_after_rows, pause_until; found {dict(item)!r}")
        faults.append(fault)
    return tuple(faults)


def check_model_name(name: str, where: str = "registered model name") -> str:
    """``name`` if MLflow accepts it as a registered model's name and the registry's searches
    can quote it (checked when the job is loaded, so a bad name never costs a job)."""
    if not name.strip() or any(char in name for char in "/:'"):
        raise ConfigError(f"{where} {name!r}: expected a non-empty name without '/', ':' or "
                          "a quote")
    return name


def _mlflow(raw: Mapping[str, Any], where: str) -> MlflowConfig:
    _reject_unknown(raw, {"experiment", "tracking_uri", "registered_model"}, where)

    def text(key: str, default: str | None, optional: bool) -> str | None:
        value = raw.get(key, default)
        if (value is None and optional) or (isinstance(value, str) and value):
            return value
        raise ConfigError(f"{where}.{key}: expected a non-empty string, found {value!r}")

    registered = text("registered_model", None, optional=True)
    if registered is not None:
        check_model_name(registered, f"{where}.registered_model")
    return MlflowConfig(experiment=text("experiment", "antdt", optional=False) or "antdt",
                        tracking_uri=text("tracking_uri", None, optional=True),
                        registered_model=registered)
