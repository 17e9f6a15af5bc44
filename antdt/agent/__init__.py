"""The agent (AntDT's Agent): one long-running Dask task per worker that trains the rows the
sharding service leases to it.

- :mod:`~antdt.agent.contract`: what an application hands in (trainer and reader factories)
  and gets back (:class:`AgentReport`), and what one agent is asked to do (:class:`AgentSpec`);
- :mod:`~antdt.agent.loop`: the loop (lease, read, ``mode.step``, commit) and its end;
- :mod:`~antdt.agent.modes`: the training modes, the loop's one seam;
- :mod:`~antdt.agent.plugin`: the worker plugin (cancellation flags, finished trainers) and
  what a master runs on workers;
- :mod:`~antdt.agent.faults`: injected faults for tests and benchmarks.
"""

from antdt.agent.contract import (AgentReport, AgentSpec, Outcome, Reader, ReaderFactory,
                                  SavedModel, Trainer, TrainerFactory, event_topic)
from antdt.agent.faults import CRASH_EXIT_CODE, Faults
from antdt.agent.loop import Agent, run_agent
from antdt.agent.plugin import (PLUGIN_NAME, AgentPlugin, cancel_here, forget_here, pause_profiler,
                                plugin_of, register, resume_profiler)

__all__ = [
    "CRASH_EXIT_CODE", "PLUGIN_NAME", "Agent", "AgentPlugin", "AgentReport", "AgentSpec",
    "Faults", "Outcome", "Reader", "ReaderFactory", "SavedModel", "Trainer", "TrainerFactory",
    "cancel_here",
    "event_topic", "forget_here", "pause_profiler", "plugin_of", "register", "resume_profiler",
    "run_agent",
]
