"""The tasks AntDT's master runs on workers for a job: the agent and the application's hooks.

The application's code arrives as pickles (:class:`~antdt.jobs.spec.JobCode`) and is opened
here, on the worker, never on the scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distributed import get_worker

from antdt.agent import AgentReport, AgentSpec, plugin_of, run_agent
from antdt.jobs.spec import load


def agent_task(spec: AgentSpec, trainer: bytes, reader: bytes) -> AgentReport:
    """Run one agent (:func:`antdt.agent.run_agent`) with the job's pickled factories."""
    return run_agent(spec, load(trainer, "trainer"), load(reader, "reader"))


def hook_task(hooks: bytes, method: str, *args: Any) -> Any:
    """Call ``hooks.<method>(*args)`` of the job's pickled :class:`~antdt.jobs.spec.JobHooks`."""
    return getattr(load(hooks, "hooks"), method)(*args)


def finish_task(job: str, hooks: bytes, run: Mapping[str, Any], report: Mapping[str, Any],
                with_model: bool) -> Any:
    """``hooks.finish`` on this worker, with the trainer the job's finished agent left here
    (``with_model``; identical on every worker after the final sync round) or None."""
    trainer = plugin_of(get_worker()).trainer(job) if with_model else None
    return load(hooks, "hooks").finish(run, trainer, report)
