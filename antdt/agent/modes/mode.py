"""What a training mode implements on a worker (:class:`WorkerMode`) and on the job's master
(:class:`MasterMode`).

A mode decides its loop (:meth:`WorkerMode.train`, over the parts every mode shares: the
agent's lease, read, commit and report, :class:`AgentParts`), what a step does to the model, when
a trained row's effect is safe (in what a joiner, a checkpoint and the final model copy: the
ledger counts it done only then), how a worker joins a running job, and how the job's final
state is formed. The replica modes (async, independent) train in the agent's lease loop
(:meth:`AgentParts.train_leases`: lease, read, ``mode.step``, commit); the synchronous mode
has a step loop of its own (:mod:`~antdt.agent.modes.synchronous`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

from distributed import Worker

from antdt.agent.contract import AgentSpec, Outcome, Reader, SavedModel, Trainer
from antdt.agent.faults import FaultInjector
from antdt.errors import AntdtError
from antdt.sharding.client import ShardClient


class Declined(AntdtError):
    """A worker could not join a running job (typically its final state was forming); it
    trained nothing."""


class AgentParts(Protocol):
    """What every mode's loop uses of its agent (:class:`antdt.agent.loop.Agent`): the spec, the
    worker, the shard client (lease, commit), the reader, the injected faults, the cancellation
    flag, the rows trained so far, and the ways to count a batch, send an event and ask the
    job's state."""

    spec: AgentSpec
    worker: Worker
    shards: ShardClient
    reader: Reader[Any]
    faults: FaultInjector
    cancelled: threading.Event
    rows: int

    def train_leases(self) -> Outcome:
        """The replica modes' loop: lease, read, ``mode.step``, commit, until the end."""

    def count(self, rows: int, busy_s: float, cpu_s: float, loss: float) -> None:
        """A batch of ``rows`` was trained in ``busy_s`` (``cpu_s`` of the training thread's CPU
        time) with mean ``loss`` (nan: no loss): counted and reported."""

    def event(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` to the job's master on the agent's event topic."""

    def job_state(self) -> str:
        """The job's state as the sharding service has it (``finished``, ``stopped``, ...)."""


class WorkerMode(Protocol):
    """One worker's side of a training mode, driven by the agent in this order: ``start`` once,
    then ``train`` (its loop; in the replica modes the agent's lease loop calls ``step`` for
    every batch, ``synced_rows``/``confirm`` around the ledger's RPCs, ``waiting`` while the
    agent waits), then ``finish`` when the job finished, or ``stop`` / (the leases given back) /
    ``leave`` / ``check`` when it did not.

    ``joined_from`` is the member whose model a joiner copied; ``exchanges`` and ``waited_s`` go
    into the agent's report (model exchanges made, seconds training waited for them);
    ``exchanged_bytes`` the bytes its exchanges received (None: a mode that does not count
    them), which the agent's progress events carry to the job's metrics;
    ``threads`` are the ids of the threads the mode runs beside the training thread (their
    warnings reach ``antdt logs``); ``group_rows`` the rows a model shared by a group of ranks
    trained since the group formed (the synchronous mode; 0 in the replica modes)."""

    joined_from: str | None
    group_rows: int

    @property
    def exchanges(self) -> int: ...

    @property
    def waited_s(self) -> float: ...

    @property
    def exchanged_bytes(self) -> int | None: ...

    @property
    def threads(self) -> Collection[int]: ...

    def tables_stats(self) -> dict[str, float] | None:
        """What the trainer saw of sharded tables (pull and push times, pushes in flight, the
        staleness bound's waits), for the agent's progress events; None: the mode holds its
        tables itself."""

    def start(self, join: bool) -> None:
        """Take part in the job's model; a joiner copies a live member's model first. Raises
        :class:`Declined` when a joiner cannot join."""

    def train(self, agent: AgentParts) -> Outcome:
        """Train until the job finishes or stops or the agent is cancelled."""

    def step(self, batch: Any, rows_after: int) -> float:
        """Train one batch; ``rows_after`` is the worker's stream of trained rows once it is
        counted (:attr:`antdt.sharding.client.ShardClient.trained_rows`). Returns the loss."""

    def synced_rows(self, trained_rows: int, waiting: bool) -> int:
        """How many of the worker's ``trained_rows`` have their effect in what a joiner, a
        checkpoint and the final model copy (read before each report to the ledger);
        ``waiting``: the ledger made the worker wait for rows, so the mode should hurry."""

    def confirm(self, rows: int) -> None:
        """The ledger accepted ``rows`` synced rows of this worker."""

    def waiting(self) -> None:
        """The agent waits (a pause): go on with whatever makes the job advance."""

    def settle(self, cancelled: threading.Event) -> None:
        """Before the agent stops leasing for a while: bring its trained rows to synced, within
        a bounded time (or until ``cancelled``)."""

    def checkpoint(self, copy_ledger: Callable[[], Mapping[str, Any]], folder: str
                   ) -> tuple[Mapping[str, Any], Any]:
        """The job's ledger (``copy_ledger()``, every worker's synced rows under ``synced``) and
        the trainer's checkpoint state holding exactly the rows that copy counts done; called
        from another thread between two steps. ``folder``: the checkpoint's version folder,
        where a model too large to gather is written in parts (the state is then a
        :class:`SavedModel`)."""

    def finish(self) -> Trainer[Any] | SavedModel | None:
        """The job finished: form the final state (every row's effect in the final model);
        the trainer holding it on this worker, kept for the master, the files the final model
        was written to when no worker could hold it (:attr:`AgentSpec.model_dir`), or None
        when the final model is held or written elsewhere."""

    def stop(self) -> None:
        """The job did not finish here: stop taking part (before the leases are given back)."""

    def leave(self) -> None:
        """After the leases were given back: leave the job's model (its peers take out what the
        ledger will hand out again)."""

    def check(self) -> None:
        """Raise the failure of the mode's own threads, if any."""


class OwnTables:
    """The part of a :class:`WorkerMode` whose tables are not the async mode's sharded ones
    (a replica, or the sync mode's shards): nothing to say of them."""

    def tables_stats(self) -> dict[str, float] | None:
        return None


class EverySynced:
    """The part of a :class:`WorkerMode` whose trained rows are in the job's model as soon as
    they are trained (one model per worker; a synchronous step): every trained row counts as
    synced, nothing is provisional, nothing but training advances the model."""

    def synced_rows(self, trained_rows: int, waiting: bool) -> int:
        return trained_rows

    def confirm(self, rows: int) -> None:
        """Nothing is provisional."""

    def waiting(self) -> None:
        """Nothing advances but training."""

    def settle(self, cancelled: threading.Event) -> None:
        """Every trained row is synced already."""


class MasterMode(Protocol):
    """The job master's side of a training mode: starts the job's model with its first
    workers, forms it anew after a restart and tells whether a joiner is still welcome.
    ``regroups``: the job's model does not survive the loss of one worker (the synchronous
    mode's shards), so the master forms it again on every live worker from the last checkpoint
    when any agent is lost."""

    regroups: bool
    tables_inflight: int | None
    """The async mode's tables are sharded (the agents' staleness bound K), or None."""

    def start(self, job: str, workers: Collection[str]) -> None:
        """The job's model begins with ``workers``."""

    def restart(self, job: str, workers: Collection[str]) -> None:
        """The job's model begins again with ``workers`` (after a restore)."""

    def accepts_joiners(self, job: str) -> bool:
        """Whether a worker that arrives now can still join (False once the final state is
        forming: a joiner would train nothing)."""

    def tables(self, job: str) -> dict[str, Any] | None:
        """Where the job's sharded tables are (buckets per worker, moves, lost ones), for its
        record; None: the mode holds no sharded tables (or the job's are forgotten)."""

    def stale_refused(self, job: str) -> int:
        """The stale calls about the job's model refused so far (of workers the scheduler
        removed, or of a rank of an older forming: :mod:`antdt.fencing`)."""

    def partitioned(self, job: str) -> dict[str, str]:
        """The job's workers its model cannot reach now (the async mode's members that reach
        no sync peer), each with why: their monitor's verdict ``partitioned``."""
