"""Training modes: what a step does to the model, when a trained row's effect is safe, how a
worker joins and how the final state forms (:class:`WorkerMode`, :class:`MasterMode`).

One module a mode: :mod:`~antdt.agent.modes.asynchronous` (AntDT-ND: replicas synchronised in
the background), :mod:`~antdt.agent.modes.synchronous` (AntDT-DD: one model sharded across the
workers, synchronous steps with per-worker batches) and :mod:`~antdt.agent.modes.independent`
(one model per worker, no sync); :mod:`~antdt.agent.modes.hybrid` is the async mode with the
tables sharded over the workers. A new mode is one module beside them, chosen in
:func:`worker_mode`.
"""

from __future__ import annotations

import torch
from distributed import Worker

from antdt.agent.contract import AgentSpec, TrainerFactory
from antdt.agent.modes.asynchronous import AsyncMaster, AsyncMode
from antdt.agent.modes.hybrid import HybridMaster, HybridMode
from antdt.agent.modes.independent import IndependentMode
from antdt.agent.modes.mode import AgentParts, Declined, MasterMode, WorkerMode
from antdt.agent.modes.sync_master import Rendezvous, SyncMaster
from antdt.agent.modes.synchronous import GroupBroken, SyncMode


def worker_mode(spec: AgentSpec, make_trainer: TrainerFactory, device: torch.device,
                worker: Worker) -> WorkerMode:
    """The worker side of ``spec``'s mode on ``worker``; it builds its trainer with
    ``make_trainer`` on ``device`` (the synchronous mode once its rank joined the group)."""
    if spec.mode == "sync":
        return SyncMode(spec, make_trainer, device, worker)
    if spec.sync_period is None:
        return IndependentMode(make_trainer(device))
    if spec.tables_inflight is not None:
        return HybridMode(make_trainer.remote_tables(device), spec.job, worker,
                          spec.sync_period, spec.tables_inflight, spec.model_dir)
    return AsyncMode(make_trainer(device), spec.job, worker, spec.sync_period)


__all__ = ["AgentParts", "AsyncMaster", "AsyncMode", "Declined", "GroupBroken", "HybridMaster",
           "HybridMode", "IndependentMode",
           "MasterMode", "Rendezvous", "SyncMaster", "SyncMode", "WorkerMode", "worker_mode"]
