"""The tasks AntDT's master runs on workers for a job: their preparation, the agent and the
application's hooks.

The application's code arrives as pickles (:class:`~antdt.jobs.spec.JobCode`) and is opened
here, on the worker, never on the scheduler.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

from distributed import get_worker
from distributed.utils import sync

import torch

from antdt import rpc
from antdt.agent import (AgentReport, AgentSpec, SavedModel, Trainer, TrainerFactory, plugin_of,
                         run_agent)
from antdt.device import FROZEN_HEAP
from antdt.errors import CheckpointError
from antdt.jobs import checkpoints
from antdt.jobs.spec import load


def prepare_worker(modules: Sequence[str]) -> None:
    """Ready a worker for its agent (the master runs it on each before training starts):
    import the job's ``modules`` (seconds per process that are not training), then settle the
    heap (:meth:`~antdt.device.FrozenHeap.settle`) so that no full collection over them holds
    up the agent's start."""
    for module in modules:
        importlib.import_module(module)
    FROZEN_HEAP.settle()


def agent_task(spec: AgentSpec, trainer: bytes, reader: bytes,
               restore: str | None = None) -> AgentReport:
    """Run one agent (:func:`antdt.agent.run_agent`) with the job's pickled factories; with
    ``restore`` (a checkpoint version folder) its trainer starts from the checkpoint's model:
    its ``model.pt``, or the parts a sync job's ranks wrote (a :class:`SavedModel`: each rank
    reads only its own shards of them)."""
    make = load(trainer, "trainer")
    if restore is not None:
        manifest = checkpoints.read_manifest(restore)
        make = _Restored(make, checkpoints.load_model(manifest)
                         if checkpoints.MODEL in manifest.files
                         else SavedModel(manifest.path, checkpoints.model_files(manifest)))
    return run_agent(spec, make, load(reader, "reader"))


def checkpoint_task(job: str, path: str) -> dict[str, Any]:
    """Write a checkpoint of ``job`` into the version folder ``path``: the model of its agent
    running here and the job's ledger, copied together (:meth:`AgentPlugin.checkpoint_state`:
    the model holds exactly the rows the ledger counts done). Returns each file's size and
    checksum, the ledger's counters (a manifest's ``rows``), the worker and the seconds it
    took. A model too large to gather is written into ``path`` by the ranks of its sync job,
    each its own part, and listed here."""
    worker = get_worker()
    started = time.perf_counter()

    def copy_ledger() -> Mapping[str, Any]:
        return rpc.ok(sync(worker.loop, worker.scheduler.antdt_ledger_copy, job=job),
                      error=CheckpointError)

    ledger, state = plugin_of(worker).checkpoint_state(job, copy_ledger, path)
    taken = time.perf_counter()
    files = {checkpoints.LEDGER: checkpoints.write(checkpoints.join(path, checkpoints.LEDGER),
                                                   ledger["ledger"])}
    if isinstance(state, SavedModel):
        files.update(state.files)
    else:
        files[checkpoints.MODEL] = checkpoints.save_model(
            checkpoints.join(path, checkpoints.MODEL), state)
    return {"files": files, "rows": checkpoints.ledger_rows(ledger), "worker": worker.address,
            "copy_s": taken - started, "write_s": time.perf_counter() - taken}


def hook_task(hooks: bytes, method: str, *args: Any) -> Any:
    """Call ``hooks.<method>(*args)`` of the job's pickled :class:`~antdt.jobs.spec.JobHooks`."""
    return getattr(load(hooks, "hooks"), method)(*args)


def finish_task(job: str, hooks: bytes, run: Mapping[str, Any], report: Mapping[str, Any],
                with_model: bool) -> Any:
    """``hooks.finish`` on this worker, with the trainer the job's finished agent left here
    (``with_model``; identical on every worker after the final sync round) or None."""
    trainer = plugin_of(get_worker()).trainer(job) if with_model else None
    return load(hooks, "hooks").finish(run, trainer, report)


class _Restored:
    """A trainer factory whose trainers start from a checkpoint's model ``state``."""

    def __init__(self, make: TrainerFactory, state: Any) -> None:
        self.make = make
        self.state = state

    def __call__(self, device: torch.device) -> Trainer[Any]:
        trainer = self.make(device)
        trainer.restore_state(self.state)
        return trainer

    def remote_tables(self, device: torch.device) -> Any:
        """The sharded tables' trainer, its dense part and its hosts' initial rows from the
        checkpoint."""
        trainer = self.make.remote_tables(device)
        trainer.restore_state(self.state)
        return trainer
