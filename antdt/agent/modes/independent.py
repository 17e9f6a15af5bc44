"""The independent mode: one model per worker and no model sync (tests, the local runs, the
baselines that compare data splits). A trained row's effect is in its worker's model at once,
so every trained row counts as synced."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from antdt.agent.contract import Outcome, Trainer
from antdt.agent.modes.mode import AgentParts, EverySynced, OwnTables


class IndependentMode(EverySynced, OwnTables):
    """:class:`~antdt.agent.modes.WorkerMode` of a worker that trains its own model alone."""

    joined_from: str | None = None
    group_rows = 0
    exchanges = 0
    waited_s = 0.0
    exchanged_bytes = 0
    threads: Collection[int] = ()

    def __init__(self, trainer: Trainer[Any]) -> None:
        self.trainer = trainer

    def start(self, join: bool) -> None:
        """Nothing to join: a worker's model is its own."""

    def train(self, agent: AgentParts) -> Outcome:
        return agent.train_leases()

    def step(self, batch: Any, rows_after: int) -> float:
        return self.trainer.step(batch)

    def checkpoint(self, copy_ledger: Callable[[], Mapping[str, Any]], folder: str
                   ) -> tuple[Mapping[str, Any], Any]:
        return copy_ledger(), self.trainer.checkpoint_state()

    def finish(self) -> Trainer[Any]:
        """The worker's model is its final state."""
        return self.trainer

    def stop(self) -> None:
        """Nothing runs beside training."""

    def leave(self) -> None:
        """No peer holds this worker's rows."""

    def check(self) -> None:
        """No thread of its own can fail."""
