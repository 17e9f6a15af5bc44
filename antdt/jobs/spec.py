"""What a client hands AntDT's master to run a job, and what the master reports back.

A job is a :class:`JobSpec`: a :class:`JobPlan` of plain values the master reads (the Parquet
row groups, batch and shard sizes, epochs, the sync period, the sharding mode, faults to inject)
and :class:`JobCode`, the application's code as pickled bytes that the master never unpickles:
only workers do, in the tasks it starts for the job. The framework stays ignorant of models,
data formats and tracking; the application hands it

* ``trainer`` and ``reader``: the agent's :class:`~antdt.agent.TrainerFactory` and
  :class:`~antdt.agent.ReaderFactory` (built on each worker);
* ``hooks``: a :class:`JobHooks` that starts the job's tracking run, logs its metrics, evaluates
  and logs the final model, and closes the run when the job fails or is cancelled.

The master's view of a job travels as a plain dict (:meth:`antdt.jobs.runner.JobRunner.record`);
:class:`antdt.sharding.JobState` names where it stands.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

import cloudpickle
from dask.utils import format_bytes

from antdt.errors import CheckpointError, JobError
from antdt.jobs.checkpoints import Every
from antdt.sharding.dealing import MAX_EPOCHS, MAX_ROW_GROUPS, MAX_ROWS, MAX_SHARDS
from antdt.sync.period import DEFAULT_PERIOD

PLUGIN_NAME = "antdt-jobs"
"""The job service's name, ``scheduler.plugins[PLUGIN_NAME]`` (:mod:`antdt.jobs.service`): named
here, with the rest its clients share with it, so the job pages (:mod:`antdt.watch.pages`) find
the service on the scheduler without importing it (nor torch)."""

Mode = Literal["async", "sync"]
"""The plan's training mode (:data:`antdt.agent.contract.Mode`, named again here: the clients
of the job service (``antdt status``, ``logs``, ``cancel``) import this module, never torch)."""
Sharding = Literal["antdt", "pull", "static"]
SHARDINGS: tuple[Sharding, ...] = ("antdt", "pull", "static")
MODES: tuple[Mode, ...] = ("async", "sync")

FAULT_KEYS = frozenset({"slowdown", "hang_after_rows", "crash_after_rows", "slow_for_rows",
                        "pause_until", "pause_after_rows"})
"""The fields of :class:`antdt.agent.Faults`."""

MAX_CODE_BYTES = 64 * 2**20
READER_MEMORY_SHARE = 0.25
"""The share of a worker's memory limit a reader may take for one row group (it holds the
row group's columns while it cuts batches from them; the model and the optimiser hold the
rest)."""


@dataclass(frozen=True)
class JobPlan:
    """The plain values of a job: what the master, the ledger and the agents need.

    ``mode``: ``async`` (a full replica per worker, synchronised in the background) or ``sync``
    (one model sharded across the workers, synchronous steps; ``batch_rows`` is then the global
    batch, split equally among the ranks at the start, and with ``adaptive_batch`` the
    controller sizes the local batches by the workers' speed, their sum fixed:
    :mod:`antdt.agent.modes.synchronous`).
    ``row_groups`` are ``(path, row_group, num_rows)`` of every training row group (bad ones
    included, so their rows are counted) and ``quarantine`` the bad units ``(path, row_group or
    None, reason)``. ``sync_period`` is a :class:`~antdt.sync.SyncPeriod` as text (``"4 peer
    batches"``, ``"1 batch"``, ``"0.1s"``). ``faults`` map the index of a worker in the sorted
    initial worker list to the fields of its :class:`~antdt.agent.Faults`. ``deadline_s``: stop
    the job if training takes longer (its rows not done count as lost). ``workers``: train on at
    most that many workers, the least busy when the job starts (fewest other jobs' agents and
    tasks; a worker joins only while the job has fewer live agents), so several jobs share a
    cluster side by side (None: every worker, and every worker that joins).
    ``min_batches_per_worker``: train on fewer workers when each would see fewer batches than
    this (0: never; see :meth:`fitted_workers`). ``replica_bytes``: the memory every worker
    holds for its full replica of the model (the async mode); a job is refused before anything
    starts when a worker's memory limit is smaller (:meth:`check_memory`; None: not checked).
    ``tables``: the async mode's tables kept sharded over the workers (:mod:`antdt.tables`):
    ``placement`` (``sharded``, or ``auto``: only when a worker's memory limit is below
    :attr:`replica_bytes`) and the fields of :class:`antdt.tables.service.TablesSpec` (None:
    replicated; see :meth:`sharded_tables`).
    ``preload``: modules every worker imports before the agents start (the training stack takes
    seconds to import). ``tags``: free text the master shows in ``status`` (never secrets).

    Checkpoints (:mod:`antdt.jobs.checkpoints`): with ``checkpoint_dir`` (a local path or an
    fsspec URL every process of the cluster reaches), a checkpoint every ``checkpoint_every``
    (rows, or a duration such as ``"60s"``) under ``<checkpoint_dir>/<job id>/``, the newest
    ``checkpoint_keep`` kept. ``fingerprint``: what a resumed job must not change (``{key:
    value}``, written into every checkpoint). ``resume``: the checkpoint version folder the job
    starts from (its ledger and model; the same tracking run).
    """

    name: str
    row_groups: list[tuple[str, int, int]]
    batch_rows: int
    shard_rows: int
    mode: Mode = "async"
    adaptive_batch: bool = True
    epochs: int = 1
    seed: int = 0
    sync_period: str = str(DEFAULT_PERIOD)
    sharding: Sharding = "antdt"
    threads: int = 1
    quarantine: list[tuple[str, int | None, str]] = field(default_factory=list)
    faults: dict[int, dict[str, Any]] = field(default_factory=dict)
    deadline_s: float | None = None
    workers: int | None = None
    min_batches_per_worker: int = 0
    preload: list[str] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    checkpoint_dir: str | None = None
    checkpoint_every: str = "60s"
    checkpoint_keep: int = 3
    fingerprint: dict[str, str] = field(default_factory=dict)
    resume: str | None = None
    replica_bytes: int | None = None
    tables: dict[str, Any] | None = None
    row_bytes: int | None = None

    def __post_init__(self) -> None:
        self.check_sizes()

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the wire (msgpack): lists, and the fault keys as strings."""
        plan = asdict(self)
        plan["row_groups"] = [list(group) for group in self.row_groups]
        plan["quarantine"] = [list(item) for item in self.quarantine]
        plan["faults"] = {str(index): dict(faults) for index, faults in self.faults.items()}
        return plan

    @classmethod
    def from_dict(cls, raw: object) -> JobPlan:
        """Validate ``raw`` (from the wire: anything) into a plan, or raise :class:`JobError`
        naming the key and what was expected."""
        if not isinstance(raw, Mapping):
            raise JobError(f"job plan: expected a mapping, found {type(raw).__name__}")
        unknown = sorted(map(repr, set(raw) - {f for f in cls.__dataclass_fields__}))
        if unknown:
            raise JobError(f"job plan: unknown key(s) {unknown}")
        name = _text(raw, "name")
        groups = raw.get("row_groups")
        if not isinstance(groups, (list, tuple)) or len(groups) > MAX_ROW_GROUPS:
            raise JobError(f"job plan row_groups: expected a list of at most {MAX_ROW_GROUPS} "
                           f"(path, row_group, num_rows), found {type(groups).__name__}"
                           f"{_length(groups)}")
        row_groups = []
        for i, group in enumerate(groups):
            if not (isinstance(group, (list, tuple)) and len(group) == 3
                    and isinstance(group[0], str) and _is_int(group[1]) and _is_int(group[2])):
                raise JobError(f"job plan row_groups[{i}]: expected (path, row_group, num_rows),"
                               f" found {str(group)[:120]}")
            row_groups.append((group[0], int(group[1]), int(group[2])))
        quarantine = []
        for i, item in enumerate(_list(raw, "quarantine", MAX_ROW_GROUPS)):
            if not (isinstance(item, (list, tuple)) and len(item) == 3
                    and isinstance(item[0], str) and (item[1] is None or _is_int(item[1]))
                    and isinstance(item[2], str)):
                raise JobError(f"job plan quarantine[{i}]: expected (path, row_group or None, "
                               f"reason), found {str(item)[:120]}")
            quarantine.append((item[0], None if item[1] is None else int(item[1]), item[2]))
        mode = raw.get("mode", "async")
        if mode not in MODES:
            raise JobError(f"job plan mode: expected one of {list(MODES)}, found {mode!r}")
        adaptive = raw.get("adaptive_batch", True)
        if not isinstance(adaptive, bool):
            raise JobError(f"job plan adaptive_batch: expected true or false, found "
                           f"{adaptive!r}")
        sharding = raw.get("sharding", "antdt")
        if sharding not in SHARDINGS:
            raise JobError(f"job plan sharding: expected one of {list(SHARDINGS)}, found "
                           f"{sharding!r}")
        deadline = raw.get("deadline_s")
        if deadline is not None and (isinstance(deadline, bool)
                                     or not isinstance(deadline, (int, float))
                                     or not math.isfinite(deadline) or deadline <= 0):
            raise JobError(f"job plan deadline_s: expected seconds > 0 or None, found "
                           f"{deadline!r}")
        return cls(
            name=name, row_groups=row_groups, batch_rows=_int(raw, "batch_rows", 1, high=MAX_ROWS),
            shard_rows=_int(raw, "shard_rows", 1, high=MAX_ROWS), mode=mode,
            adaptive_batch=adaptive,
            epochs=_int(raw, "epochs", 1, default=1, high=MAX_EPOCHS),
            seed=_int(raw, "seed", 0, default=0, high=2**63 - 1),
            sync_period=_text(raw, "sync_period", default=str(DEFAULT_PERIOD)), sharding=sharding,
            threads=_int(raw, "threads", 1, default=1, high=1024), quarantine=quarantine,
            faults=_faults(raw.get("faults", {})),
            deadline_s=None if deadline is None else float(deadline),
            workers=None if raw.get("workers") is None else _int(raw, "workers", 1, high=100_000),
            min_batches_per_worker=_int(raw, "min_batches_per_worker", 0, default=0),
            preload=[_module(i, name) for i, name in enumerate(_list(raw, "preload"))],
            tags=_tags(raw.get("tags", {})),
            checkpoint_dir=_optional_text(raw, "checkpoint_dir", 4096),
            checkpoint_every=_every(raw.get("checkpoint_every", "60s")),
            checkpoint_keep=_int(raw, "checkpoint_keep", 1, default=3, high=10_000),
            fingerprint=_tags(raw.get("fingerprint", {}), "fingerprint"),
            resume=_optional_text(raw, "resume", 4096),
            replica_bytes=None if raw.get("replica_bytes") is None
            else _int(raw, "replica_bytes", 1),
            tables=_tables(raw.get("tables")),
            row_bytes=None if raw.get("row_bytes") is None else _int(raw, "row_bytes", 1))

    @property
    def rows(self) -> int:
        """Rows of one epoch, quarantined ones included."""
        return sum(rows for _, _, rows in self.row_groups)

    def fitted_workers(self, available: int) -> tuple[int, str | None]:
        """How many of ``available`` workers the job trains on, and why, when that is fewer
        than it asks for (``workers``, or every one available).

        A replica of the async mode that trains only a few dozen batches syncs only a few
        dozen times, and the replicas drift apart while the model is learning fastest: with 2
        workers a job of 18 batches a worker ended 0.077 AUC below the same job in one process,
        one of 73 batches 0.009 below, one of 293 0.003 below. So every worker gets at least
        ``min_batches_per_worker`` batches (counting every epoch), down to one worker.

        A sync job steps on one global batch of ``batch_rows`` rows whatever its number of
        ranks, so its size sets no such bound; only every rank needs a row of each global batch.

        >>> JobPlan("j", [("a.parquet", 0, 50_000)], batch_rows=3, shard_rows=16,
        ...         mode="sync").fitted_workers(4)
        (3, 'a global batch of 3 rows has a row for at most 3 ranks; training on 3')

        >>> plan = JobPlan("j", [("a.parquet", 0, 50_000)], batch_rows=4096, shard_rows=16384,
        ...                workers=4, min_batches_per_worker=128)
        >>> plan.fitted_workers(8)
        (1, '13 batches of 4,096 rows: fewer than min_batches_per_worker (128) for each of 4 \
workers; training on 1')
        >>> JobPlan("j", plan.row_groups, batch_rows=4096, shard_rows=16384).fitted_workers(4)
        (4, None)
        """
        asked = available if self.workers is None else self.workers
        if self.mode == "sync":
            fitted = min(asked, self.batch_rows)
            why = None if fitted == asked else (
                f"a global batch of {self.batch_rows:,} rows has a row for at most "
                f"{self.batch_rows:,} ranks; training on {fitted}")
            return min(fitted, available), why
        if self.min_batches_per_worker <= 0 or asked <= 1:
            return min(asked, available), None
        batches = -(-self.rows * self.epochs // self.batch_rows)
        fitted = max(1, min(asked, batches // self.min_batches_per_worker))
        why = None if fitted == asked else (
            f"{batches:,} batches of {self.batch_rows:,} rows: fewer than "
            f"min_batches_per_worker ({self.min_batches_per_worker}) for each of {asked} "
            f"workers; training on {fitted}")
        return min(fitted, available), why

    def sharded_tables(self, limits: Mapping[str, int | None]) -> dict[str, Any] | None:
        """The tables spec when the job's tables are sharded (async mode, ``tables`` set, and
        placed ``sharded`` or ``auto`` with a worker's memory limit (``limits``) below
        :attr:`replica_bytes`); None: replicated (or the sync mode's own sharding).

        >>> spec = {"placement": "auto", "total_rows": 10, "dim": 4}
        >>> plan = JobPlan("j", [], batch_rows=1, shard_rows=1, replica_bytes=2**30, tables=spec)
        >>> plan.sharded_tables({"a": 2**31}) is None, plan.sharded_tables({"a": 2**29})
        (True, {'total_rows': 10, 'dim': 4})
        """
        if self.mode != "async" or self.tables is None:
            return None
        spec = {k: v for k, v in self.tables.items() if k not in ("placement", "bytes")}
        if self.tables.get("placement") == "sharded":
            return spec
        need = self.replica_bytes
        short = need is not None and any(limit and limit < need for limit in limits.values())
        return spec if short else None

    def check_memory(self, limits: Mapping[str, int | None]) -> None:
        """Refuse the job (:class:`JobError`, one line) when a worker it would train on has a
        memory limit below :attr:`replica_bytes`: its replica could never fit, and the worker
        would be restarted (and the job with it) once it got there. ``limits``: the workers'
        Dask memory limits (0 or None: no limit).

        >>> plan = JobPlan("j", [], batch_rows=1, shard_rows=1, replica_bytes=3 * 2**30)
        >>> plan.check_memory({"tcp://a:1": 2**30, "tcp://b:1": 0})
        Traceback (most recent call last):
        ...
        antdt.errors.JobError: the model needs 3.00 GiB per worker in async mode (every worker \
holds a full replica), but worker tcp://a:1's memory limit is 1.00 GiB; shard its tables over \
the workers (model.tables: sharded or auto), train it with --mode sync, or give the workers more \
memory
        """
        need = self.replica_bytes
        if need is None:
            return
        short = sorted((limit, worker) for worker, limit in limits.items()
                       if limit and limit < need)
        if not short:
            return
        limit, worker = short[0]
        more = f" ({len(short)} of the job's {len(limits)} workers have less than it needs)" \
            if len(short) > 1 else ""
        raise JobError(f"the model needs {format_bytes(need)} per worker in async mode (every "
                       f"worker holds a full replica), but worker {worker}'s memory limit is "
                       f"{format_bytes(limit)}{more}; shard its tables over the workers "
                       "(model.tables: sharded or auto), train it with --mode sync, or give "
                       "the workers more memory")

    def check_sharded_memory(self, limits: Mapping[str, int | None]) -> None:
        """Refuse the job (:class:`JobError`, one line) when its sharded tables (``tables``'
        ``bytes``: weights and optimiser state), twice (every bucket has a backup), spread over
        the workers of ``limits`` would not fit a worker's memory limit.

        >>> plan = JobPlan("j", [], batch_rows=1, shard_rows=1,
        ...                tables={"placement": "sharded", "bytes": 4 * 2**30})
        >>> plan.check_sharded_memory({"a": 2**30, "b": 2**30})
        Traceback (most recent call last):
        ...
        antdt.errors.JobError: the sharded tables need 4.00 GiB per worker (4.00 GiB of weights and optimiser state, with a backup of each bucket, over 2 workers), but worker a's memory limit is 1.00 GiB; add workers, give them more memory, or train it with --mode sync
        """
        size = (self.tables or {}).get("bytes")
        if not size or not limits:
            return
        need = -(-2 * int(size) // len(limits))
        short = sorted((limit, worker) for worker, limit in limits.items()
                       if limit and limit < need)
        if short:
            limit, worker = short[0]
            raise JobError(f"the sharded tables need {format_bytes(need)} per worker "
                           f"({format_bytes(int(size))} of weights and optimiser state, with a "
                           f"backup of each bucket, over {len(limits)} workers), but worker "
                           f"{worker}'s memory limit is {format_bytes(limit)}; add workers, "
                           "give them more memory, or train it with --mode sync")


    def check_sizes(self) -> None:
        """Refuse (:class:`JobError`, one line) sizes the job could never run with, where it is
        built and again where it is submitted, before any worker does anything for it: more
        epochs than :data:`~antdt.sharding.dealing.MAX_EPOCHS`, more shards an epoch than
        :data:`~antdt.sharding.dealing.MAX_SHARDS`, a batch larger than the data.

        >>> JobPlan("j", [("a.parquet", 0, 10**9)], batch_rows=512, shard_rows=1)
        Traceback (most recent call last):
        ...
        antdt.errors.JobError: job plan shard_rows: shards of 1 row cut the 1,000,000,000 rows into 1,000,000,000 shards, more than the 2,000,000 a job may have; use shard_rows >= 500
        """
        if not 1 <= self.epochs <= MAX_EPOCHS:
            raise JobError(f"job plan epochs: expected 1 to {MAX_EPOCHS:,} epochs, found "
                           f"{self.epochs:,}")
        for key, rows in (("batch_rows", self.batch_rows), ("shard_rows", self.shard_rows)):
            if not 1 <= rows <= MAX_ROWS:
                raise JobError(f"job plan {key}: expected 1 to {MAX_ROWS:,} rows, found "
                               f"{rows:,}")
        if len(self.row_groups) > MAX_ROW_GROUPS:
            raise JobError(f"job plan row_groups: expected at most {MAX_ROW_GROUPS:,} row "
                           f"groups, found {len(self.row_groups):,}; write larger ones")
        shard = self.shard_rows
        shards = sum(-(-rows // shard) for _, _, rows in self.row_groups)
        if shards > MAX_SHARDS:
            least = -(-max(shards * shard, 1) // MAX_SHARDS)
            raise JobError(f"job plan shard_rows: shards of {shard:,} row{'s' * (shard > 1)} "
                           f"cut the {self.rows:,} rows into {shards:,} shards, more than the "
                           f"{MAX_SHARDS:,} a job may have; use shard_rows >= {least:,}")
        if self.row_groups and self.batch_rows > self.rows:
            raise JobError(f"job plan batch_rows: a batch of {self.batch_rows:,} rows is larger "
                           f"than the data ({self.rows:,} rows an epoch)")

    def check_cluster(self, limits: Mapping[str, int | None]) -> None:
        """Refuse (:class:`JobError`, one line) a job the cluster's workers (``limits``: their
        Dask memory limits, 0 or None: none) could never hold, before any of them starts on
        it: sharded tables (with a backup of each bucket) larger than their memory together, a
        full replica larger than any one worker's, a row group whose rows (``row_bytes`` each,
        in the reader's memory) exceed :data:`READER_MEMORY_SHARE` of the smallest limit.

        >>> plan = JobPlan("j", [("a.parquet", 3, 10**6)], batch_rows=512, shard_rows=4096,
        ...                row_bytes=1000)
        >>> plan.check_cluster({"a": 2**30})
        Traceback (most recent call last):
        ...
        antdt.errors.JobError: row group 3 of a.parquet holds 1,000,000 rows, 0.93 GiB in the reader (1,000 bytes a row), more than a worker's budget for it (256.00 MiB: 0.25 of the smallest memory limit, 1.00 GiB); write smaller row groups or give the workers more memory
        """
        known = [limit for limit in limits.values() if limit]
        if not known:
            return
        size = int((self.tables or {}).get("bytes") or 0)
        if size and self.sharded_tables(limits) is not None and 2 * size > sum(known):
            raise JobError(f"the sharded tables need {format_bytes(2 * size)} with a backup of "
                           f"each bucket, more than the {len(known)} workers' memory together "
                           f"({format_bytes(sum(known))}); add workers or give them more memory")
        if self.mode == "async" and self.sharded_tables(limits) is None \
                and all(limits.values()) and (self.replica_bytes or 0) > max(known):
            self.check_memory(limits)  # no worker could hold a replica
        if self.row_bytes and self.row_groups:
            path, group, rows = max(self.row_groups, key=lambda item: item[2])
            budget = int(READER_MEMORY_SHARE * min(known))
            need = rows * self.row_bytes
            if need > budget:
                raise JobError(
                    f"row group {group} of {path} holds {rows:,} rows, {format_bytes(need)} in "
                    f"the reader ({self.row_bytes:,} bytes a row), more than a worker's budget "
                    f"for it ({format_bytes(budget)}: {READER_MEMORY_SHARE:g} of the smallest "
                    f"memory limit, {format_bytes(min(known))}); write smaller row groups or "
                    "give the workers more memory")


class JobHooks(Protocol):
    """The application's side of a job, run in tasks on workers (so a worker's loss costs a
    retry, not the job). ``run`` is what :meth:`start` returned: the tracking run's identity,
    plain data the master keeps and hands to the later hooks.

    * :meth:`start`: open the tracking run (params, config); before training. With
      ``resume`` (a job restarting from a checkpoint: ``run``, the run it continues;
      ``checkpoint``, the version folder; ``step``, the next metrics step; ``rows_replayed``
      and ``resumes``, counted over the job's life) reopen that run instead and record the
      resume in it.
    * :meth:`metrics`: log ``steps`` of ``(step, {name: value})``; every few seconds.
    * :meth:`finish`: evaluate ``trainer`` (the job's consensus model on this worker; None when
      the job was stopped early) and log it with ``report`` (the master's account of the job:
      counters, timings, agents, controller actions, lease spans); close the run and return
      the job's summary (plain data, shown by ``follow`` and ``status``).
    * :meth:`abort`: close the run as ``status`` ("FAILED" or "KILLED") with ``reason``.
    """

    def start(self, job_id: str, workers: int, resume: Mapping[str, Any] | None = None
              ) -> dict[str, Any]: ...

    def metrics(self, run: Mapping[str, Any], steps: Sequence[tuple[int, dict[str, float]]]
                ) -> None: ...

    def finish(self, run: Mapping[str, Any], trainer: Any, report: Mapping[str, Any]
               ) -> dict[str, Any]: ...

    def abort(self, run: Mapping[str, Any], status: str, reason: str) -> None: ...


@dataclass(frozen=True)
class JobCode:
    """The application's code for a job, pickled on the client: the agents' trainer and reader
    factories and the :class:`JobHooks`. Kept apart so that an agent unpickles only the training
    stack, and a hook task only the tracking side."""

    trainer: bytes
    reader: bytes
    hooks: bytes

    @classmethod
    def of(cls, trainer: object, reader: object, hooks: JobHooks) -> JobCode:
        return cls(cloudpickle.dumps(trainer), cloudpickle.dumps(reader),
                   cloudpickle.dumps(hooks))

    def to_dict(self) -> dict[str, bytes]:
        return {"trainer": self.trainer, "reader": self.reader, "hooks": self.hooks}

    @classmethod
    def from_dict(cls, raw: object) -> JobCode:
        """Check ``raw`` (from the wire) is three pickles of sane size; they are not unpickled
        here (the master never runs the application's code)."""
        if not isinstance(raw, Mapping) or set(raw) != {"trainer", "reader", "hooks"}:
            keys = sorted(raw) if isinstance(raw, Mapping) else type(raw).__name__
            raise JobError(f"job code: expected a mapping of trainer, reader and hooks, found "
                           f"{keys}")
        for key, value in raw.items():
            if not isinstance(value, bytes) or not 0 < len(value) <= MAX_CODE_BYTES \
                    or not value.startswith(b"\x80"):
                raise JobError(f"job code {key}: expected a pickle of at most {MAX_CODE_BYTES} "
                               f"bytes, found {type(value).__name__} of "
                               f"{len(value) if isinstance(value, bytes) else '?'} bytes")
        return cls(raw["trainer"], raw["reader"], raw["hooks"])


@dataclass(frozen=True)
class JobSpec:
    """A job as submitted: its plan and its code."""

    plan: JobPlan
    code: JobCode


def load(data: bytes, what: str) -> Any:
    """Unpickle a piece of :class:`JobCode` on a worker (a clear error when it does not load)."""
    try:
        return cloudpickle.loads(data)
    except (pickle.UnpicklingError, AttributeError, ImportError, EOFError, TypeError) as exc:
        raise JobError(f"job code {what} does not load on this worker: {exc!r}") from exc


# ---- validation helpers -------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _int(raw: Mapping[str, Any], key: str, low: int, default: int | None = None,
         high: int = 2**62) -> int:
    value = raw.get(key, default)
    if not _is_int(value) or not low <= value <= high:
        most = f" and <= {high:,}" if high < 2**62 else ""
        raise JobError(f"job plan {key}: expected an int >= {low}{most}, found "
                       f"{repr(value)[:80]}")
    return int(value)


def _length(value: object) -> str:
    return f" of {len(value)}" if isinstance(value, (list, tuple)) else ""


def _text(raw: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str) or not 0 < len(value) <= 256:
        raise JobError(f"job plan {key}: expected a str of 1 to 256 characters, found "
                       f"{str(value)[:80]!r}")
    return value


def _list(raw: Mapping[str, Any], key: str, longest: int = 1000) -> list[Any]:
    value = raw.get(key, [])
    if not isinstance(value, (list, tuple)) or len(value) > longest:
        raise JobError(f"job plan {key}: expected a list of at most {longest}, found "
                       f"{type(value).__name__}")
    return list(value)


def _module(index: int, name: object) -> str:
    if not isinstance(name, str) or not name.replace(".", "").replace("_", "").isalnum():
        raise JobError(f"job plan preload[{index}]: expected a module name, found {name!r}")
    return name


def _faults(raw: object) -> dict[int, dict[str, Any]]:
    if not isinstance(raw, Mapping):
        raise JobError(f"job plan faults: expected a mapping of worker index to faults, found "
                       f"{type(raw).__name__}")
    faults = {}
    for index, fields in raw.items():
        if not (isinstance(index, int) or (isinstance(index, str) and index.isdigit())):
            raise JobError(f"job plan faults: expected worker indices, found {index!r}")
        if not isinstance(fields, Mapping) or not set(fields) <= FAULT_KEYS:
            raise JobError(f"job plan faults[{index}]: expected a mapping of "
                           f"{sorted(FAULT_KEYS)}, found {str(fields)[:120]}")
        faults[int(index)] = dict(fields)
    return faults


def _tags(raw: object, key: str = "tags") -> dict[str, str]:
    if not isinstance(raw, Mapping) or len(raw) > 32 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 1024
            for k, v in raw.items()):
        raise JobError(f"job plan {key}: expected at most 32 str: str entries, found "
                       f"{str(raw)[:120]}")
    return dict(raw)


def _optional_text(raw: Mapping[str, Any], key: str, longest: int) -> str | None:
    value = raw.get(key)
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= longest):
        raise JobError(f"job plan {key}: expected a str of 1 to {longest} characters or None, "
                       f"found {str(value)[:80]!r}")
    return value


def _every(value: object) -> str:
    try:
        return str(Every.parse(value, where="job plan checkpoint_every"))
    except CheckpointError as exc:
        raise JobError(str(exc)) from exc


def _tables(value: object) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or value.get("placement") not in ("auto", "sharded") \
            or not all(isinstance(key, str) for key in value) \
            or not _is_int(value.get("bytes", 0)):
        raise JobError(f"job plan tables: expected a mapping with placement 'auto' or "
                       f"'sharded' (and bytes, an int >= 0), found {str(value)[:120]}")
    return dict(value)
