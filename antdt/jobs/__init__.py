"""Jobs on a long-lived Dask cluster: AntDT's master runs each job's control on the scheduler,
next to the services that own its ledger, controller and sync groups, so a job outlives the
client that submitted it and several jobs share one cluster.

=============================  ====================================================================
:mod:`antdt.jobs.spec`         what a client submits (:class:`JobSpec`: a plan of plain values and
                               the application's code as pickles); where a job stands is
                               :class:`JobState`, shared with the ledger (:mod:`antdt.sharding`)
:mod:`antdt.jobs.runner`       one job's control loop on the scheduler (its lifecycle), handed a
                               :class:`~antdt.jobs.runner.JobContext` by the service
:mod:`antdt.jobs.placement`    which workers get a job's agents: at the start, joiners, restarts
:mod:`antdt.jobs.journal`      agents' events and controller actions in; log, record, report out
:mod:`antdt.jobs.metrics`      a job's metrics on their way to its tracking run
:mod:`antdt.jobs.keeper`       a job's checkpoints as its master takes them
:mod:`antdt.jobs.checkpoints`  the checkpoints' files: versions, manifests, the progress note
:mod:`antdt.jobs.calls`        the master's calls into workers (never blocking the scheduler)
:mod:`antdt.jobs.service`      :class:`~antdt.jobs.service.JobService`, the scheduler plugin
:mod:`antdt.jobs.tasks`        the tasks the master runs on workers (agents, the hooks)
:mod:`antdt.jobs.client`       :class:`JobClient`: submit, follow, status, logs, cancel
=============================  ====================================================================
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from antdt.jobs.spec import JobCode, JobHooks, JobPlan, JobSpec
from antdt.sharding import JobState

if TYPE_CHECKING:
    from antdt.jobs.client import JobClient, ensure_plugins


def __getattr__(name: str) -> Any:
    """The client's names, imported on first use (they import Dask's distributed): a job file
    is read, and a local job trained, without it."""
    if name not in ("JobClient", "ensure_plugins"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("antdt.jobs.client"), name)


__all__ = ["JobClient", "JobCode", "JobHooks", "JobPlan", "JobSpec", "JobState",
           "ensure_plugins"]
