"""The agents' worker plugin (:class:`AgentPlugin`): per worker, each job's cancellation flag,
its running agent (a checkpoint copies its model) and a finished agent's trainer until the job's
master is done with it. The functions beside it are what a master runs on workers
(``client.run``): cancel an agent, forget a job.

Cancellation is cooperative (a running Dask task cannot be interrupted): :func:`cancel_here`
sets the flag; the agent checks it between batches and while it hangs or pauses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from distributed import Client, Worker
from distributed.diagnostics.plugin import WorkerPlugin
from tornado.ioloop import PeriodicCallback

from antdt import config
from antdt.agent.contract import Trainer
from antdt.agent.modes import WorkerMode
from antdt.errors import AntdtError

PLUGIN_NAME = "antdt-agent"
"""``worker.plugins[PLUGIN_NAME]``: the :class:`AgentPlugin`."""

PROFILER_CALLBACKS = ("profile", "profile-cycle")
"""A Dask worker's periodic callbacks of its statistical profiler."""


def pause_profiler(worker: Worker) -> list[PeriodicCallback]:
    """Stop ``worker``'s statistical profiler (from any thread); return what was stopped."""
    paused = [callback for name in PROFILER_CALLBACKS
              if (callback := worker.periodic_callbacks.get(name)) is not None
              and callback.is_running()]
    for callback in paused:
        worker.loop.add_callback(callback.stop)
    return paused


def resume_profiler(worker: Worker, paused: list[PeriodicCallback]) -> None:
    """Start again what :func:`pause_profiler` stopped."""
    for callback in paused:
        worker.loop.add_callback(callback.start)


class AgentPlugin(WorkerPlugin):
    """Per worker: each job's cancellation flag, its running agent's mode (a checkpoint copies
    its model), and the trainer of a finished agent until the job's master is done with it (it
    evaluates and logs the model here) and forgets the job (:func:`forget_here`)."""

    name = PLUGIN_NAME
    idempotent = True  # registering again (another job, another driver) keeps the state

    def __init__(self) -> None:
        self._cancel: dict[str, threading.Event] = {}
        self._trainers: dict[str, Trainer[Any]] = {}
        self._running: dict[str, WorkerMode] = {}
        self._lock = threading.Lock()
        self._paused: list[PeriodicCallback] = []  # Dask's profiler, while agents train

    def __reduce__(self) -> tuple[type[AgentPlugin], tuple[()]]:
        """Registration ships a new plugin: its state lives on one worker only."""
        return AgentPlugin, ()

    def begin(self, job: str, worker: Worker, mode: WorkerMode) -> None:
        """An agent of ``job`` trains here in ``mode`` from now on. The first agent pauses the
        worker's statistical profiler unless ``antdt.agent.dask-profiler``: it walks the
        training thread's stack 100 times a second (a few percent of a core, and the GIL), and
        the agents report their own batch times."""
        keep = config.flag("antdt.agent.dask-profiler")
        with self._lock:
            self._running[job] = mode
            if len(self._running) > 1 or keep:
                return
            self._paused = pause_profiler(worker)

    def end(self, job: str, worker: Worker) -> None:
        """``job``'s agent stopped training here; the last one resumes what :meth:`begin`
        paused."""
        with self._lock:
            self._running.pop(job, None)
            if self._running:
                return
            resume_profiler(worker, self._paused)
            self._paused = []

    def cancelled(self, job: str) -> threading.Event:
        """``job``'s cancellation flag on this worker (made on first use, set by the driver)."""
        return self._cancel.setdefault(job, threading.Event())

    def keep(self, job: str, trainer: Trainer[Any]) -> None:
        self._trainers[job] = trainer

    def trainer(self, job: str) -> Trainer[Any]:
        """The trainer the finished agent of ``job`` left on this worker."""
        trainer = self._trainers.get(job)
        if trainer is None:
            raise AntdtError(f"no finished agent of job {job!r} on this worker; finished jobs "
                             f"here: {sorted(self._trainers)}")
        return trainer

    def state(self, job: str) -> Any:
        return self.trainer(job).state()

    def checkpoint_state(self, job: str, copy_ledger: Callable[[], Mapping[str, Any]],
                         folder: str) -> tuple[Mapping[str, Any], Any]:
        """A checkpoint of ``job``'s agent training here, taken between two steps: the job's
        ledger (``copy_ledger()``, with every worker's synced rows under ``synced``) and the
        agent's :meth:`Trainer.checkpoint_state`, holding exactly the rows that ledger counts
        done (:meth:`antdt.agent.modes.WorkerMode.checkpoint`; a model too large to gather is
        written into the version ``folder`` in parts, a :class:`SavedModel`)."""
        mode = self._running.get(job)
        if mode is None:
            raise AntdtError(f"no agent of job {job!r} is training on this worker; training "
                             f"here: {sorted(self._running)}")
        return mode.checkpoint(copy_ledger, folder)

    def forget(self, job: str) -> None:
        self._cancel.pop(job, None)
        self._trainers.pop(job, None)
        self._running.pop(job, None)


def plugin_of(worker: Worker) -> AgentPlugin:
    """``worker``'s :class:`AgentPlugin`."""
    plugin = worker.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, AgentPlugin):
        raise AntdtError(f"worker {worker.address} has no {PLUGIN_NAME!r} plugin: call "
                         "antdt.agent.register(client) before starting agents")
    return plugin


def register(client: Client) -> None:
    """Put :class:`AgentPlugin` on every worker, present and future (idempotent)."""
    client.register_plugin(AgentPlugin())


def cancel_here(job: str, dask_worker: Worker) -> None:
    """Ask this worker's agent of ``job`` to stop at its next check (``client.run``)."""
    plugin_of(dask_worker).cancelled(job).set()


def forget_here(job: str, dask_worker: Worker) -> None:
    """Drop ``job``'s flag and finished trainer on this worker (``client.run``)."""
    plugin_of(dask_worker).forget(job)
