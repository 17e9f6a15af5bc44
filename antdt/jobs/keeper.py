"""A job's checkpoints as its master takes them (:class:`Checkpointer`), next to its control
loop on the scheduler.

A checkpoint is taken when one is due (see :meth:`Checkpointer.due`: one completes every
``checkpoint_every`` rows trained or seconds) and no other is being written::

    a worker's task takes its running agent's replica lock between two steps
      ─► asks the scheduler for the ledger's state, now (``antdt_ledger_copy``: the ledger and
         every worker's synced rows)
      ─► copies the model's tables holding exactly the rows that ledger counts done (its base
         less the entries past each worker's synced rows, :mod:`antdt.sync.embeddings`), the
         dense parameters and optimiser state as they are; lets go of the lock
      ─► writes ledger.bin and model.pt
      ─► the master writes MANIFEST.json last (sizes, sha256), then prunes older versions

The model's embedding tables therefore hold each row the ledger counts done once, and no row it
does not; a resumed job trains every other row again, the rows trained past the checkpoint
before the loss among them (``rows_replayed``). Besides the checkpoints, the master notes the
job's rows in ``progress.json`` every tick, so a job resumed after its scheduler died knows how
many rows the lost job had trained past its checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from distributed.metrics import time

from antdt.errors import AntdtError
from antdt.jobs import checkpoints
from antdt.jobs.checkpoints import Every, Manifest
from antdt.jobs.spec import JobPlan

WriteModel = Callable[[str, str], Awaitable[dict[str, Any] | None]]
"""``write_model(worker, version_path)``: the checkpoint task's reply on ``worker`` (each file's
size and checksum under ``files``, the ledger's counters under ``rows``; None when the worker
left the cluster first)."""

MODEL_DIR = "model"
"""The folder in a job's checkpoint folder that a sync job's final model too large for one
worker is written to (:attr:`Checkpointer.model_dir`)."""

Log = Callable[[str, str], None]
"""``log(level, message)``: the job's log."""


class Checkpointer:
    """The checkpoints of one job (see the module docstring); ``enabled`` only with a
    ``checkpoint_dir``; ``written()`` is called when a checkpoint ended (the master looks
    again). ``last`` is the newest good checkpoint (written here, or resumed from); ``written``,
    ``bytes`` and ``seconds`` describe the ones this master wrote."""

    def __init__(self, job_id: str, plan: JobPlan, write_model: WriteModel, log: Log,
                 written: Callable[[], None] = lambda: None) -> None:
        self.job_id = job_id
        self.folder = None if plan.checkpoint_dir is None else \
            checkpoints.job_folder(plan.checkpoint_dir, job_id)
        self.every = Every.parse(plan.checkpoint_every)
        self.keep = plan.checkpoint_keep
        self.fingerprint = dict(plan.fingerprint)
        self.last: Manifest | None = None
        self.base: str | None = None
        """The version the job's current model started from (a restart's or a resume's point):
        never pruned while that model lives, for an agent of it may still be loading it (one
        started late, on a worker that joined after the others trained past newer checkpoints)."""
        self.written = 0
        self.bytes = 0
        self.seconds: list[float] = []
        self._write_model = write_model
        self._log = log
        self._written = written
        self._version = 0
        self._mark = (0.0, 0)
        self._taking: asyncio.Task[None] | None = None
        self._noting: asyncio.Task[None] | None = None
        self._epoch = 0
        """Checkpoints started before the job's model restarted belong to an older epoch."""
        self.failure: str | None = None
        """Why the last checkpoint failed, while no newer one completed."""

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    @property
    def model_dir(self) -> str | None:
        """Where the ranks of a sync job write its final model in parts when it does not fit
        one worker (``<checkpoint_dir>/<job_id>/model``; None without a checkpoint_dir)."""
        return None if self.folder is None else checkpoints.join(self.folder, MODEL_DIR)

    @property
    def last_path(self) -> str | None:
        """The folder of the newest good checkpoint (None: none yet)."""
        return None if self.last is None else self.last.path

    def summary(self) -> dict[str, Any]:
        """The checkpoints this master wrote: how many, the last one's bytes and path, and the
        seconds each took."""
        return {"written": self.written, "bytes": self.bytes, "seconds": list(self.seconds),
                "last": self.last_path}

    async def open(self, rows_trained: int, base: str | None = None) -> None:
        """Learn the versions already in the job's folder (a resumed job numbers on) and start
        the first interval; ``base``: the checkpoint a resumed job's model starts from."""
        self.base = base
        if self.folder is not None:
            found = await asyncio.to_thread(checkpoints.versions, self.folder)
            self._version = max(found, default=0)
        self.restart_interval(rows_trained)

    def restart_interval(self, rows_trained: int) -> None:
        self._mark = (time(), rows_trained)

    def due(self, rows_trained: int, samples_per_s: float, next_look_s: float) -> bool:
        """Whether to start a checkpoint now, so that one is complete every ``every`` rows
        trained (or seconds): a job lost just before a checkpoint completes trains at most that
        much again. It starts early by what the job trains until the master looks again
        (``next_look_s``) and while the last checkpoint took to write, at ``samples_per_s``."""
        if not self.enabled or self._taking is not None:
            return False
        since, rows = self._mark
        lead_s = next_look_s + (self.seconds[-1] if self.seconds else 0.0)
        if self.every.rows is not None:
            return rows_trained - rows + samples_per_s * lead_s >= self.every.rows
        assert self.every.seconds is not None
        return time() - since + lead_s >= self.every.seconds

    def take(self, worker: str, rows_trained: int, step: int, run: Mapping[str, Any] | None,
             extra: Mapping[str, Any]) -> None:
        """Start writing a checkpoint of ``worker``'s agent's model and the ledger (copied
        together on the worker); the interval restarts now (at ``rows_trained``), whether it
        succeeds or not."""
        assert self.folder is not None
        self.restart_interval(rows_trained)
        self._version += 1
        path = checkpoints.version_path(self.folder, self._version)
        self._taking = asyncio.ensure_future(self._take(path, worker, step, dict(run or {}),
                                                        dict(extra), self._epoch))

    async def settle(self, timeout_s: float) -> None:
        """The job's model is lost and restarts from the newest checkpoint: wait (at most
        ``timeout_s``) for the one being written, then fence it off. A checkpoint that completes
        after the restart chose its point gets no manifest: it would be newer than the point the
        new model starts from, so the next restart's count of replayed rows would start from it
        (too few), and with ``checkpoint_keep: 1`` it would prune the checkpoint the new agents
        are loading."""
        task = self._taking
        if task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), timeout_s)
        self._epoch += 1
        self._taking = None

    async def _take(self, path: str, worker: str, step: int, run: dict[str, Any],
                    extra: dict[str, Any], epoch: int) -> None:
        started = time()
        try:
            written = await self._write_model(worker, path)
            if written is None:
                self._failed(f"checkpoint {path} not taken: {worker} left the cluster while "
                             "writing it")
                return
            if epoch != self._epoch:
                self._log("warning", f"checkpoint {path} discarded: the job's model restarted "
                                     "from an older checkpoint while it was written")
                return
            files, rows = written["files"], written["rows"]
            manifest = Manifest(job_id=self.job_id, version=self._version, path=path,
                                created=time(), files=files, rows=rows, step=step,
                                run=run or None, fingerprint=self.fingerprint, worker=worker,
                                write_s=time() - started, extra=extra)
            await asyncio.to_thread(checkpoints.write_manifest, manifest)
            self.last = manifest
            self.failure = None
            self.written += 1
            self.bytes = sum(int(f["bytes"]) for f in files.values())
            self.seconds.append(manifest.write_s)
            self._log("info", f"checkpoint {path}: {rows['done']:,} rows done, "
                              f"{self.bytes / 1e6:.1f} MB in {manifest.write_s:.2f}s")
            assert self.folder is not None
            for gone in await asyncio.to_thread(checkpoints.prune, self.folder, self.keep,
                                                self.base):
                self._log("info", f"checkpoint {gone} deleted (keeping the newest {self.keep})")
        except (AntdtError, OSError) as exc:
            self._failed(f"checkpoint {path} failed: {exc}")
        finally:
            if epoch == self._epoch:
                self._taking = None
                self._written()  # the next one may be due already

    def _failed(self, message: str) -> None:
        self.failure = message
        self._log("warning", message)

    def note(self, progress: Mapping[str, Any]) -> None:
        """Replace ``progress.json`` with ``progress`` unless the previous note is still being
        written (a slow store skips notes rather than queueing them)."""
        if self.folder is None or self._noting is not None:
            return
        self._noting = asyncio.ensure_future(self._note(dict(progress)))

    async def _note(self, progress: dict[str, Any]) -> None:
        assert self.folder is not None
        try:
            await asyncio.to_thread(checkpoints.note, self.folder, progress)
        except AntdtError as exc:
            self._log("warning", f"could not note the job's progress: {exc}")
        finally:
            self._noting = None

    async def close(self, progress: Mapping[str, Any]) -> None:
        """Wait for the checkpoint being written (a finishing job keeps its last one whole),
        then note the job's final ``progress``."""
        for task in (self._taking, self._noting):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.folder is not None:
            self._noting = None
            await self._note(dict(progress))

    async def latest(self) -> Manifest | None:
        """The newest good checkpoint in the job's folder (torn or corrupt newer ones are
        skipped, with a warning naming them)."""
        if self.folder is None:
            return None
        found = await asyncio.to_thread(checkpoints.latest, self.folder,
                                        lambda message: self._log("warning", message))
        return found
