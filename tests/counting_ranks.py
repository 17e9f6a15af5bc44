"""What the ranks of the chaos bench's counting-trainer test run (``from counting_ranks import
...``): module-level functions for :class:`ranks.Ranks`."""

from __future__ import annotations

import os
from typing import Any

import torch

from antdt.agent import SavedModel
from pipeline.bench.chaos_sync import CountingShardsRecipe
from ranks import Group

ROWS = 10
STEP_PARTS = {0: [[0], [9]], 1: [], 2: [[4, 4, 5]]}
"""Each rank's batch of one step, as the reader's parts: rank 0's spans two, rank 1 has no
rows, rank 2 has a row twice; 5 rows in all."""


def restore_step_and_write(group: Group, folder: str, saved: str,
                           files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A counting trainer of ``ROWS`` rows in ``folder`` that writes its model in parts:
    restored from the parts ``files`` in ``saved``, one step of :data:`STEP_PARTS`, its parts
    written into ``<folder>/written``, its state gathered on rank 0."""
    trainer = CountingShardsRecipe(ROWS, epochs=2, folder=folder, parts=True)(
        torch.device("cpu"))
    trainer.restore_state(SavedModel(saved, files))
    trainer.step(trainer.batch([torch.tensor(part) for part in STEP_PARTS[group.rank]]), 5)
    return {"token": trainer.token, "parts": trainer.parts,
            "refusal": trainer.gather_refusal(0),
            "written": trainer.write_shards(os.path.join(folder, "written")),
            "state": trainer.full_state(0)}
