"""What a job's restarts cost and when they must stop (:class:`Recovery`), and the ledger a
restart or a resumed job begins from (:func:`restore_ledger`).

A job's model is lost when every worker dies (any mode), when one rank of a synchronous group
is lost (its shards go with it), or with the scheduler (the job is resubmitted with
``--resume``). The job then starts a new model from its newest complete checkpoint (or from the
start) and trains again what the lost model held past that point: ``rows_replayed``, the rows
trained twice over the job's life, summed over its restarts as

    rows the lost model held  -  rows the checkpoint it restarts from holds

The lost model held the rows its forming began from (the ledger's count then) and every row it
trained since. The ledger learns a trained row only with its commit, which a worker sends once
per ``antdt.sharding.commit-interval``, so a rank that dies takes rows the ledger never counted;
the ranks of a synchronous group that survive it know them (every rank sees every step's rows)
and report them as they stop (``group_rows``). Where none survives the count is the ledger's: a
lower bound, short of the rows the lost workers trained since their last commit.

A job whose model keeps being lost before a newer checkpoint completes would train the same
rows again and again: after ``antdt.jobs.restarts-per-checkpoint`` restarts from one point it
fails instead, naming why its checkpoints did not complete.
"""

from __future__ import annotations

import asyncio
import posixpath
from typing import Any

from antdt import config
from antdt.errors import JobError, LedgerError
from antdt.jobs import checkpoints
from antdt.jobs.checkpoints import Manifest
from antdt.jobs.spec import JobPlan
from antdt.sharding.service import ShardingService


class Recovery:
    """One job's restarts: the rows its lost models held past the points the job restarted
    from (``rows_replayed``), how often it restarted or resumed (``resumes``), and the
    restarts since its newest checkpoint."""

    def __init__(self, rows_replayed: int = 0, resumes: int = 0) -> None:
        self.rows_replayed = rows_replayed
        self.resumes = resumes
        self.limit = int(config.number("antdt.jobs.restarts-per-checkpoint", low=1,
                                       integer=True))
        self._base = 0
        self._group_rows = 0
        self._point: str | None = None
        self._restarts = 0

    def began(self, rows_trained: int) -> None:
        """A model begins, holding ``rows_trained`` rows (the ledger's count)."""
        self._base = rows_trained
        self._group_rows = 0

    def reported(self, group_rows: int) -> None:
        """A rank of the current model's group saw it train ``group_rows`` rows since it
        formed."""
        self._group_rows = max(self._group_rows, group_rows)

    def held(self, rows_trained: int) -> int:
        """The rows the current model holds: the ledger's ``rows_trained``, or more where a
        rank saw steps the ledger was not told of."""
        return max(rows_trained, self._base + self._group_rows)

    def restart(self, rows_trained: int, point: Manifest | None, why: str,
                failure: str | None) -> int:
        """The current model is lost (the ledger counts ``rows_trained``), and the job restarts
        from checkpoint ``point`` (None: from the start): the rows trained again. Raises
        :class:`JobError` when the job restarted from that same point too often (``why`` it
        restarts, ``failure``: why the last checkpoint failed, if one did)."""
        key = None if point is None else point.path
        self._restarts = self._restarts + 1 if key == self._point else 1
        self._point = key
        if self._restarts > self.limit:
            where = "the start" if point is None else f"checkpoint {point.path}"
            raise JobError(
                f"{why}; the job's model was lost {self._restarts} times with {where} its "
                "newest point to restart from (no newer checkpoint completed in between"
                + (f"; the last one: {failure}" if failure else "")
                + f"): it stops rather than train those rows again "
                f"(antdt.jobs.restarts-per-checkpoint: {self.limit})")
        restored = 0 if point is None else int(point.rows["trained"])
        replayed = self.held(rows_trained) - restored
        self.rows_replayed += replayed
        self.resumes += 1
        self.began(restored)
        return replayed


async def restore_ledger(sharding: ShardingService, job_id: str, plan: JobPlan,
                         manifest: Manifest) -> None:
    """Job ``job_id``'s ledger as checkpoint ``manifest`` has it (replacing the current one, if
    any); its row groups must be the plan's."""
    data = await asyncio.to_thread(checkpoints.load_ledger, manifest)
    sharding.forget(job_id)
    try:
        ledger = sharding.restore_bytes(job_id, data)
    except LedgerError as exc:
        raise JobError(f"checkpoint {manifest.path}: {exc}") from exc
    state = ledger.to_state()
    groups = [(state.paths[f], int(g), int(n)) for f, g, n in
              zip(state.rg_file, state.rg_group, state.rg_rows)]
    if groups != [tuple(g) for g in plan.row_groups]:
        sharding.forget(job_id)
        raise JobError(f"cannot resume from {manifest.path}: data.train differs (the "
                       f"checkpoint has {len(groups)} row groups of "
                       f"{sum(n for *_, n in groups):,} rows, the job "
                       f"{len(plan.row_groups)} of {plan.rows:,})")


async def lost_job(path: str) -> tuple[Manifest, dict[str, Any]]:
    """The checkpoint version folder ``path`` a resubmitted job resumes from, and the lost
    job's last progress note (``{}`` when it has none of that job): the rows it had trained
    past the checkpoint are in the note. The ledger's checksum is checked when it is loaded,
    the model's by every agent that loads it (reading it here too would be a third read)."""
    manifest = await asyncio.to_thread(checkpoints.read_manifest, path)
    note = await asyncio.to_thread(checkpoints.read_note, posixpath.dirname(path))
    return manifest, note if note is not None and note.get("job_id") == manifest.job_id else {}
