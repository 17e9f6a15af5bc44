"""What an application hands the agent and what the agent hands back: the trainer and reader
it builds on the worker (:class:`TrainerFactory`, :class:`ReaderFactory`), the spec of one
agent (:class:`AgentSpec`), its report (:class:`AgentReport`) and the event topic its progress
travels on.

``antdt`` knows nothing of models or data: the training step and the reader are handed in as
factories that the worker calls, so only small picklable recipes travel, never a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import torch

from antdt.agent.faults import Faults
from antdt.errors import ConfigError
from antdt.sync.period import DEFAULT_PERIOD, SyncPeriod

Outcome = Literal["finished", "stopped", "cancelled", "declined"]
Mode = Literal["async", "sync"]
"""A job's training mode: ``async`` (AntDT-ND: a full replica per worker, synchronised in the
background) or ``sync`` (AntDT-DD: one model sharded across the workers, synchronous steps)."""
"""How an agent ended: the job ``finished`` (final state formed, trainer kept for the master),
the job was ``stopped`` early, the master ``cancelled`` the agent, or a joiner ``declined``: it
could not join the running job (typically the final round had formed), trained nothing."""

B_co = TypeVar("B_co", covariant=True)
B_contra = TypeVar("B_contra", contravariant=True)


class Reader(Protocol[B_co]):
    """Turns rows ``[start, stop)`` of one row group into a batch (e.g. ``data.reader``)."""

    def read(self, path: str, row_group: int, start: int, stop: int) -> B_co: ...


class Trainer(Protocol[B_contra]):
    """One worker's model and its training step (e.g. a wrapper of ``models.TrainStep``).

    ``dense`` and ``tables`` are the live tensors the async mode synchronises in place: the dense
    parameters (updated by the step's optimiser) and the embedding tables ``(num_rows, dim)``
    (views of the storage the step updates). ``touched(batch)`` names, per table, the row ids
    ``(k,)`` int64 the step on ``batch`` changes. ``state()`` is what the driver fetches at the
    end (e.g. the model's weights on the CPU). ``checkpoint_state(tables)`` is everything a
    resumed job needs to go on exactly (weights and every optimiser's state, tensors copied:
    training goes on while it is written), with ``tables`` (same names and shapes as
    :meth:`tables`) in place of the live tables when given, and ``restore_state(state)`` puts it
    back in place (before the replica is built on the tables).
    """

    def step(self, batch: B_contra) -> float: ...

    def touched(self, batch: B_contra) -> Mapping[str, torch.Tensor]: ...

    def dense(self) -> Sequence[torch.Tensor]: ...

    def tables(self) -> Mapping[str, torch.Tensor]: ...

    def state(self) -> Any: ...

    def checkpoint_state(self, tables: Mapping[str, torch.Tensor] | None = None) -> Any: ...

    def restore_state(self, state: Any) -> None: ...


class TrainerFactory(Protocol):
    """Builds the trainer on the worker, on ``device``; must be picklable. ``remote_tables``
    builds the trainer of the async mode with sharded tables instead
    (:class:`antdt.agent.modes.hybrid.TableTrainer`)."""

    def __call__(self, device: torch.device) -> Trainer[Any]: ...

    def remote_tables(self, device: torch.device) -> Any: ...


class ReaderFactory(Protocol):
    """Builds the reader on the worker; must be picklable."""

    def __call__(self) -> Reader[Any]: ...


@dataclass(frozen=True)
class AgentSpec:
    """What one agent does: train ``job``'s leases in batches of ``batch_rows`` rows (unless the
    controller set this worker another size: a lease carries it), in ``mode``.

    ``sync_period``: the async mode's background sync period; None trains without model sync
    (every trained row counts as synced: one model per worker, for tests and the local modes).
    ``join``: the worker joined a running job; it copies a live member's model before training
    (:meth:`antdt.sync.background.BackgroundSync.start`). ``threads``: torch threads. ``device``:
    forced device (default: :func:`antdt.device.pick_device` on the worker: cuda when it has a
    GPU). ``model_dir``: where the ranks of a synchronous job write its final model, each its
    own part (:class:`SavedModel`), when the whole would not fit the worker that gathers it
    (None: such a job is refused as its group forms). ``tables_inflight``: the async mode's
    tables are sharded over the workers, with this staleness bound K (None: replicated).
    """

    job: str
    batch_rows: int
    mode: Mode = "async"
    sync_period: SyncPeriod | None = DEFAULT_PERIOD
    join: bool = False
    threads: int = 1
    device: str | None = None
    faults: Faults = field(default_factory=Faults)
    model_dir: str | None = None
    tables_inflight: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.batch_rows, bool) or not isinstance(self.batch_rows, int) \
                or self.batch_rows < 1:
            raise ConfigError(f"agent batch_rows must be an int >= 1, found {self.batch_rows!r}")
        if self.mode not in ("async", "sync"):
            raise ConfigError(f"agent mode must be 'async' or 'sync', found {self.mode!r}")
        if self.sync_period is not None and not isinstance(self.sync_period, SyncPeriod):
            raise ConfigError(f"agent sync_period must be a SyncPeriod or None, found "
                              f"{self.sync_period!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ConfigError(f"agent threads must be an int >= 1, found {self.threads!r}")


@dataclass(frozen=True)
class SavedModel:
    """A model the ranks of a synchronous job wrote into ``folder``, each its own part, because
    the whole would not fit the worker that would gather it: a checkpoint holds it in place of
    ``model.pt``, and such a job's final model is one. ``files``: each file's name with its
    size and sha256 (``{"bytes": ..., "sha256": ...}``, as a checkpoint's manifest lists them).
    """

    folder: str
    files: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class AgentReport:
    """What an agent returns to the driver.

    ``rows``/``batches``: trained by this agent (rows later re-queued after its death are not its
    rows any more, but a returned agent did not die). ``seconds``: the whole task; ``busy_s``:
    reading and training (injected slowdown included); ``cpu_s``: the CPU time the training
    thread spent in them (against ``busy_s``, the share of a core it got: on a loaded machine
    the threads beside it take the rest). ``loss``: mean batch loss (nan: no batch).
    ``joined_from``: the member whose model a joiner copied. ``sync_wait_s``: seconds training
    waited for sync rounds (the replica was too far ahead; part of ``busy_s``; in the
    synchronous mode: for its peers at each step). ``holds_model``: the finished agent left the
    final model on its worker (every worker in the async mode, the first rank in the
    synchronous mode). ``saved_model``: the final model as the ranks of a synchronous job wrote
    it, when it did not fit one worker (the first rank's report; then no worker holds it).
    ``group_rows``: in the synchronous mode, the rows the group's model trained since the group
    formed, every step this rank saw complete (the master's count of what a lost model held).
    ``tables``: what the agent saw of the async mode's sharded tables
    (:meth:`~antdt.agent.modes.WorkerMode.tables_stats`; None: not sharded).
    """

    worker: str
    outcome: Outcome
    rows: int
    batches: int
    leases: int
    seconds: float
    busy_s: float
    loss: float
    exchanges: int
    device: str
    joined_from: str | None = None
    sync_wait_s: float = 0.0
    cpu_s: float = 0.0
    holds_model: bool = False
    saved_model: SavedModel | None = None
    group_rows: int = 0
    tables: dict[str, float] | None = None


def event_topic(job: str) -> str:
    """The Dask event topic an agent of ``job`` reports its progress on."""
    return f"antdt-agent-{job}"
