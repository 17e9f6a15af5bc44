"""How a job's master goes on when the job's model is lost (:class:`Restarts`, a part of
:class:`~antdt.jobs.runner.JobRunner`): every worker gone, a synchronous group broken, or the
worker holding the final model dead. The model starts again from the newest complete checkpoint
(or the start) on the workers there; what that costs is counted by
:class:`~antdt.jobs.recovery.Recovery`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from distributed import Client, Future

from antdt import config
from antdt.agent import forget_here
from antdt.errors import JobError
from antdt.jobs import calls
from antdt.jobs.checkpoints import Manifest
from antdt.jobs.keeper import Checkpointer
from antdt.jobs.placement import Placement, Slot
from antdt.jobs.recovery import Recovery, restore_ledger
from antdt.jobs.spec import JobPlan


class Job(Protocol):
    """What the restarts use of their :class:`~antdt.jobs.runner.JobRunner`."""

    job_id: str
    plan: JobPlan
    ctx: Any
    client: Client
    placement: Placement
    recovery: Recovery
    checkpoints: Checkpointer
    journal: Any
    metrics: Any
    run: dict[str, Any] | None
    _agents: dict[int, Future]
    _regroup: str | None
    _cancel: str | None
    _trained_before: int
    _tick_s: float

    def log(self, level: str, message: str) -> None: ...

    def _check_cancel(self) -> None: ...

    async def _check(self, slot: Slot, workers: Mapping[str, Any]) -> None: ...

    def _write_off(self, slot: Slot, why: str) -> None: ...

    async def _cancel_agents(self) -> None: ...

    async def _register(self, workers: int) -> None: ...

    def _enable_controller(self, workers: int) -> None: ...

    def _read_ledger(self) -> None: ...

    async def _hook(self, method: str, *args: Any) -> Any: ...

    def _resume_info(self, manifest: Manifest, step: int) -> dict[str, Any]: ...

    def _start_agent(self, worker: str, join: bool = False,
                     restore: str | None = None) -> None: ...

    async def _free_workers(self) -> list[str]: ...

    def _lost(self) -> str: ...

    def _rows_trained(self) -> int: ...

    def _restart_on(self, workers: list[str], manifest: Manifest | None,
                    replayed: int) -> None: ...

    async def _form_again(self) -> None: ...


class Restarts:
    """The restarts of a job's master (mixed into :class:`~antdt.jobs.runner.JobRunner`)."""

    _regroup: str | None
    """Why the job's group must form again (a mode that regroups lost an agent), or None."""

    async def _free_workers(self: Job) -> list[str]:
        """The cluster's workers this job may place agents on: all of them, but for a
        synchronous job those no other synchronous job placed agents on (a worker process holds
        one process group). While another holds every worker, wait for it (and say so)."""
        said = False
        while True:
            held = self.ctx.exclusive()
            free = [w for w in self.ctx.scheduler.workers if w not in held]
            if free or not self.ctx.scheduler.workers:
                return free
            if not said:
                self.log("info", "waiting for workers: every worker trains another synchronous "
                                 "job (a worker process takes part in one group at a time)")
                said = True
            await calls.until(lambda: self._cancel is not None, self._tick_s)
            self._check_cancel()

    def _lost(self: Job) -> str:
        rows = self.journal.rows
        return f"{rows.get('done', 0):,} of {rows.get('expected', 0):,} rows done"

    async def _restart(self: Job) -> None:
        """Every worker is gone, and the model with them: wait for new workers (up to
        ``antdt.sharding.no-workers-timeout``) and restart from the newest good checkpoint;
        fail naming the checkpoint to resume from when none join, or at once when there is
        no checkpoint."""
        lost = f"every agent's worker died ({len(self.placement.slots)} agents); {self._lost()}"
        await self.checkpoints.settle(config.seconds("antdt.sync-steps.collective-timeout"))
        manifest = await self.checkpoints.latest()
        if manifest is None:
            raise JobError(f"{lost}, and there is no checkpoint to restart from" + (
                "" if self.checkpoints.enabled else " (set train.checkpoint_dir to have one)"))
        timeout = config.seconds("antdt.sharding.no-workers-timeout")
        self.log("warning", f"{lost}; waiting up to {timeout:g}s for workers, to restart from "
                            f"checkpoint {manifest.path}")
        await calls.until(lambda: bool(self.ctx.scheduler.workers) or self._cancel is not None,
                          timeout)
        self._check_cancel()
        if not self.ctx.scheduler.workers:
            raise JobError(
                f"no worker joined within {timeout:g}s (antdt.sharding.no-workers-timeout) "
                f"after every worker left; the job's last checkpoint is {manifest.path}: "
                f"resume it with `antdt submit JOB.yaml --resume {self.job_id} --scheduler "
                "ADDR`")
        replayed = self.recovery.restart(self._rows_trained(), manifest, lost,
                                         self.checkpoints.failure)
        self._trained_before -= replayed  # trained here, then rolled back with the ledger
        await restore_ledger(self.ctx.sharding, self.job_id, self.plan, manifest)
        workers = self.placement.restart(await self._free_workers())
        self._restart_on(workers, manifest, replayed)
        self.run = await self._hook("start", self.job_id, len(workers),
                                    self._resume_info(manifest, self.metrics.step))
        for worker in workers:
            self._start_agent(worker, restore=manifest.path)

    async def _form_again(self: Job) -> None:
        """An agent of a mode that regroups was lost (its worker died, a collective of its
        group broke, or the worker holding the final model died): stop the others (bounded by
        the collective timeout: a rank that does not return is left out), then restart every
        live worker from the last checkpoint, or from the start (a new ledger, the initial
        model) when there is none yet. Nothing to do when the final model formed meanwhile
        (the agent lost was a rank that had done its part)."""
        why = self._regroup
        await self._cancel_agents()
        bound = config.seconds("antdt.sync-steps.collective-timeout")
        await calls.until(lambda: all(self._agents[s.index].done()
                                      for s in self.placement.live), bound)
        workers = self.ctx.scheduler.workers
        for slot in self.placement.live:
            if self._agents[slot.index].done():
                await self._check(slot, workers)
        if self.placement.final_model(self.ctx.scheduler.workers) is not None:
            self._regroup = None
            self.log("info", f"{why}; the final model formed before: the job finishes with it")
            return
        stuck = {s.worker for s in self.placement.live}
        for slot in self.placement.live:
            self._write_off(slot, f"it did not stop within {bound:g}s")
        await self.checkpoints.settle(bound)
        timeout = config.seconds("antdt.sharding.no-workers-timeout")
        await calls.until(lambda: bool(set(self.ctx.scheduler.workers) - stuck)
                          or self._cancel is not None, timeout)
        self._check_cancel()
        manifest = await self.checkpoints.latest()
        chosen = self.placement.restart([w for w in await self._free_workers()
                                         if w not in stuck])
        if not chosen:
            raise JobError(
                f"{why}; no worker joined within {timeout:g}s "
                f"(antdt.sharding.no-workers-timeout) to form the group again; {self._lost()}; "
                + (f"the job's last checkpoint is {manifest.path}: resume it with `antdt submit "
                   f"JOB.yaml --resume {self.job_id} --scheduler ADDR`" if manifest is not None
                   else "no checkpoint was written" + (
                       "" if self.checkpoints.enabled else
                       " (set train.checkpoint_dir to keep one)")))
        assert why is not None
        replayed = self.recovery.restart(self._rows_trained(), manifest, why,
                                         self.checkpoints.failure)
        self.log("warning", f"{why}; forming the group again")
        # the stopped agents' cancellation flags go, or the new agents would stop at once
        await self.client.run(forget_here, self.job_id, workers=chosen, on_error="ignore")
        self._trained_before -= replayed
        if manifest is not None:
            await restore_ledger(self.ctx.sharding, self.job_id, self.plan, manifest)
        else:
            self.ctx.sharding.forget(self.job_id)
            await self._register(len(chosen))
        self._restart_on(chosen, manifest, replayed)
        for worker in chosen:
            self._start_agent(worker, restore=None if manifest is None else manifest.path)

    def _rows_trained(self: Job) -> int:
        ledger = self.ctx.sharding.jobs.get(self.job_id)
        return ledger.summary()["rows_trained"] if ledger is not None else \
            self.journal.rows["trained"]

    def _restart_on(self: Job, workers: list[str], manifest: Manifest | None, replayed: int) -> None:
        """The mode and the controller begin again on ``workers`` from ``manifest`` (None: from
        the start)."""
        self.checkpoints.base = None if manifest is None else manifest.path
        self._regroup = None
        self._enable_controller(len(workers))
        self.ctx.mode.restart(self.job_id, workers)
        self._read_ledger()
        where = "the start" if manifest is None else f"checkpoint {manifest.path}"
        done = 0 if manifest is None else manifest.rows["done"]
        self.log("warning", f"restarting from {where} on {len(workers)} worker(s): {done:,} "
                            f"rows done; {replayed:,} rows trained past it are trained again")
        self.checkpoints.restart_interval(0 if manifest is None else manifest.rows["trained"])
