"""Training modes: what a step does to the model, when a trained row's effect is safe, how a
worker joins and how the final state forms (:class:`WorkerMode`, :class:`MasterMode`).

One module a mode: :mod:`~antdt.agent.modes.asynchronous` (AntDT-ND: replicas synchronised in
the background) and :mod:`~antdt.agent.modes.independent` (one model per worker, no sync). A new
mode is one module beside them, chosen in :func:`worker_mode`.
"""

from __future__ import annotations

from typing import Any

from distributed import Worker

from antdt.agent.contract import AgentSpec, Trainer
from antdt.agent.modes.asynchronous import AsyncMaster, AsyncMode
from antdt.agent.modes.independent import IndependentMode
from antdt.agent.modes.mode import Declined, MasterMode, WorkerMode


def worker_mode(spec: AgentSpec, trainer: Trainer[Any], worker: Worker) -> WorkerMode:
    """The worker side of ``spec``'s mode, over ``trainer`` on ``worker``."""
    if spec.sync_period is None:
        return IndependentMode(trainer)
    return AsyncMode(trainer, spec.job, worker, spec.sync_period)


__all__ = ["AsyncMaster", "AsyncMode", "Declined", "IndependentMode", "MasterMode", "WorkerMode",
           "worker_mode"]
