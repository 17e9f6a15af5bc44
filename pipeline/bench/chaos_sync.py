"""`antdt bench chaos --mode sync`: the exactly-once promise held against the final model of a
synchronous job (one model sharded over the ranks: :mod:`antdt.agent.modes.synchronous`) while
its ranks die or hang, in a step, between two leases, in a checkpoint, in the final gather and
after it, or while its scheduler is lost.

The model counts (:class:`CountingShards`, a ``ShardedTrainer``): a table of ``rows`` float32
counts cut in contiguous ranges of ids over the ranks (rank ``r`` owns the ``r``-th). A step
all-gathers every rank's row ids and each rank adds 1 to those it owns. A checkpoint holds the
table gathered on one rank, or, in half the runs (``parts``, drawn from the seed), each rank's
range written in a file of its own (the path of a model too large to gather); so does the final
model, which :func:`~pipeline.bench.chaos_run.audit` holds, row by row, against ``epochs``.

What the job trained twice. A group that breaks forms again from the last checkpoint and trains
the rows past it again, and the master counts them (``rows_replayed``). The ranks say what they
trained: as a group forms, its rank 0 draws a token and sends it to the others, and after each
step's collective every rank appends ``token step global_rows`` to a log of its own under
``<job folder>/steps/``. The rows the job trained are the sum over the distinct (token, step)
of every forming and every cluster (:func:`trained_rows`), ``trained_twice`` that less ``rows x
epochs``, and a run's ``replayed_exact`` says whether the master's ``rows_replayed`` is that.

Harm (:class:`Harm`, in the trainer's recipe: a point, the rank it hits, a threshold of the
rows the model holds). It fires once per run across every process and every forming of the
group (the first to create ``<job folder>/harm.json``, with ``O_EXCL``, fires; the file says
where and when), and only once the job has a complete checkpoint, so the group forms again from
one. ``kill`` SIGKILLs the rank's worker process (its nanny starts a new one, which the next
group forms on); ``hang`` blocks the rank's training thread for ever, so its peers' collective
times out (``antdt.sync-steps.collective-timeout``: 10 s here). Scenarios (each on a fresh
cluster of three workers, one job of three ranks unless said):

* ``mid-step``       kill before a step's collective, once the model holds a drawn share of
                     the rows;
* ``before-commit``  kill after a step's collective, its update and its log line, before the
                     step returns: the model holds the rows on every rank, the ledger does not;
* ``two-leases``     kill after the collective of the first step whose batch ends one lease and
                     begins the next (shards of 1,000 rows, local batches of 64: a lease's end
                     falls inside a step);
* ``checkpoint``     kill in a checkpoint's gather or parts write, before its collective (the
                     second checkpoint: checkpoints every second here, so one comes while the
                     ranks are held);
* ``after-manifest`` external: the bench SIGKILLs a rank's worker process the moment a
                     complete checkpoint (its ``MANIFEST.json``) exists;
* ``final``          kill in the final gather (or the final parts write), before its collective
                     (or in a checkpoint taken after the job's last step: the trainer knows a
                     gather only by the rows its model holds);
* ``finished``       kill once the final gather's collective completed: a rank > 0 at the end of
                     its gather, rank 0 in ``final()`` (with parts: any rank once every part is
                     written): the final model formed, the agents' results not yet back;
* ``finishing``      kill the worker of rank 0, which holds the final model, while it
                     evaluates and logs it (``hooks.finish``): the job's only whole model is
                     lost after every agent returned, and the group forms again (gathered
                     models only: a model in parts outlives its ranks);
* ``hang``           hang before a step's collective, once the model holds a drawn share of
                     the rows;
* ``scheduler``      the scheduler and every worker killed while the ranks are held, the
                     scheduler stopped since the check, once the master noted every row
                     trained, past its newest checkpoint; the job resumed from that checkpoint on
                     a new cluster (as ``--resume`` does), where a rank is killed mid-step;
* ``two-jobs``       two jobs submitted together on the same three workers, each with its own
                     folder, one killed mid-step; both audited.
* ``partition``, ``peer-partition``, ``scheduler-partition``: links cut, not processes
                     killed, on a cluster of hosts (network namespaces: root only), in
                     :mod:`pipeline.bench.chaos_partitions`; a run says when it healed, the
                     group's last generation (2 or more: it formed again), and the stale
                     calls of its ranks the scheduler refused (``stale_refused``).

As in the async runs, no harm depends on the job lasting long enough: every initial rank pauses,
holding no lease, once it trained its part of a drawn share of the rows (20-40%), until the
run's Dask ``Event`` is set (``pause_until``; a paused rank goes on taking part in empty steps,
in which a checkpoint is still taken, and the job cannot end meanwhile). Checkpoints come every
tenth of the rows, so one is due before the ranks are held, and the Event is set once the job
has a complete checkpoint (``checkpoint``: once the harm fired). Every harm's threshold is
reached before the job's last step (or is the job's end), so each harm fires in every run whose
job gets that far. The scheduler scenario's ranks are held at 30-60% of the rows for ever (its
checkpoints come at 40-80% of that), and the cluster is killed once every rank paused: no row
is trained between the master's last note and the kill, so the note counts every row the lost
job trained.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from antdt.agent import SavedModel
from antdt.jobs import JobClient, JobCode, JobPlan, JobSpec, checkpoints
from pipeline.bench.chaos_partitions import (NETWORK_CONFIG, PARTITION_RUNNERS,
                                             PARTITION_SCENARIOS)
from pipeline.bench.chaos_run import (EPOCHS, NOTHING_CHECKED, STEP_S, WAIT_S, AuditHooks,
                                      CountingModel, IdReaderRecipe, Run, Watch, audit, ignore,
                                      read_parts, write_data, write_part)

SYNC_SCENARIOS = ("mid-step", "before-commit", "two-leases", "checkpoint", "after-manifest",
                  "final", "finished", "finishing", "hang", "scheduler", "two-jobs",
                  *PARTITION_SCENARIOS)
WORLD = 3
"""Ranks of a job: one per worker of a run's cluster."""
LOCAL_ROWS = 64
"""A rank's local batch (the global batch is ``WORLD`` of them; adaptive batches are off)."""
SHARD_ROWS = 1_000
"""Not a multiple of the local batch, so that a lease's end falls inside a step (two-leases)."""
RATE = 10_000.0
"""Rows a second a three-rank counting job trains from its start to its end on two cores, about
(10,300 for 36,000 rows, measured once): it sizes a run's data for ``--job-s``; no run waits
on it."""
CHECKPOINTS = 10
"""A job checkpoints every ``rows x epochs / CHECKPOINTS`` rows trained."""
STEPS = "steps"
MARKER = "harm.json"

SYNC_CONFIG = {"antdt": {
    "sync-steps": {"collective-timeout": "10s"},
    "sharding": {"no-workers-timeout": "60s"},
    "jobs": {"tick": "200ms", "allow-faults": True},  # the runs inject faults (pauses, hangs)
}}
"""Dask config of every process of a sync run: a dead or hung rank breaks its peers' collective
within 10 s; the master notes the job's progress five times a second."""


def network_config() -> dict[str, Any]:
    """Dask config of every process of a partition's run: :data:`SYNC_CONFIG` with
    :data:`~pipeline.bench.chaos_partitions.NETWORK_CONFIG`."""
    settings: dict[str, Any] = dict(SYNC_CONFIG["antdt"])
    settings["sync-steps"] = {**settings["sync-steps"], **NETWORK_CONFIG["sync-steps"]}
    return {"antdt": settings}


# ---- the model (runs on the workers) ------------------------------------------------------------


@dataclass(frozen=True)
class Harm:
    """What a job's trainer does to its rank (see the module): at ``point`` (a scenario's name,
    one of ``mid-step``, ``before-commit``, ``two-leases``, ``checkpoint``, ``final``,
    ``finished``, ``hang``), on rank ``rank``, once the model holds at least ``rows`` rows;
    ``finishing`` is the hooks' (:class:`FinishingHooks`)."""

    point: str
    rank: int
    rows: int = 0


def ranges(rows: int, world_size: int) -> list[tuple[int, int]]:
    """Each rank's contiguous range of the table's ``rows`` rows.

    >>> ranges(10, 3)
    [(0, 3), (3, 6), (6, 10)]
    """
    bounds = [rows * rank // world_size for rank in range(world_size + 1)]
    return list(zip(bounds, bounds[1:]))


class CountingShards:
    """``ShardedTrainer`` (:mod:`antdt.agent.modes.synchronous`) of a model that counts, its
    table sharded by rows over the ranks of the default process group (see the module). A
    batch is the step's local row ids (``(k,)`` int64); the full state is ``{"table": (rows,)
    float32, "rows": rows the model trained}``; the parts are :func:`~pipeline.bench.
    chaos_run.write_part`'s files."""

    def __init__(self, recipe: CountingShardsRecipe) -> None:
        self.recipe = recipe
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.total = recipe.rows * recipe.epochs
        self.ranges = ranges(recipe.rows, self.world_size)
        self.start, self.stop = self.ranges[self.rank]
        self.table = torch.zeros(self.stop - self.start)
        self.model_rows = 0
        """Rows the model trained (its checkpoint's, restored, and every step's since)."""
        self.steps = 0
        self.parts = 0
        """How many of the reader's batches the step's batch was made of."""
        token: list[Any] = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        self.token = str(token[0])
        steps = Path(recipe.folder) / STEPS
        steps.mkdir(parents=True, exist_ok=True)
        self.log = steps / f"{self.token}-{self.rank}.log"

    def batch(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        self.parts = len(parts)
        return torch.cat(list(parts)) if parts else torch.zeros(0, dtype=torch.int64)

    def step(self, batch: torch.Tensor, global_rows: int) -> float:
        """Every rank's ids all-gathered (sizes first, then the ids padded to the longest);
        1 added to each this rank owns."""
        self._harm("mid-step")
        self._harm("hang")
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(batch)]))
        longest = max(int(size) for size in sizes)
        padded = torch.zeros(longest, dtype=torch.int64)
        padded[:len(batch)] = batch
        gathered = [torch.zeros(longest, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        ids = torch.cat([ids[:int(size)] for ids, size in zip(gathered, sizes)])
        mine = ids[(ids >= self.start) & (ids < self.stop)] - self.start
        self.table.index_add_(0, mine, torch.ones(len(mine)))
        time.sleep(self.recipe.step_s)
        self.model_rows += global_rows
        with open(self.log, "a") as log:
            log.write(f"{self.token} {self.steps} {global_rows}\n")
        self.steps += 1
        self._harm("before-commit")
        self._harm("two-leases", self.parts == 2)
        return 0.5

    def gather_refusal(self, dst: int) -> str | None:
        return "the recipe writes the model in parts (parts=True)" if self.recipe.parts else None

    def full_state(self, dst: int) -> dict[str, Any] | None:
        final = self.model_rows >= self.total
        self._harm("final" if final else "checkpoint")
        longest = max(stop - start for start, stop in self.ranges)
        padded = torch.zeros(longest)
        padded[:len(self.table)] = self.table
        gathered = [torch.zeros(longest) for _ in self.ranges] if self.rank == dst else None
        dist.gather(padded, gathered, dst=dst)
        self._harm("finished", final and self.rank != 0)
        if gathered is None:
            return None
        return {"table": torch.cat([part[:stop - start] for part, (start, stop)
                                    in zip(gathered, self.ranges)]),
                "rows": self.model_rows}

    def write_shards(self, folder: str) -> dict[str, dict[str, Any]]:
        """This rank's range into ``folder``; every rank's file, gathered (all ranks)."""
        final = self.model_rows >= self.total
        name, digest = write_part(folder, self.start, self.stop, self.world_size, self.table,
                                  self.model_rows, self.recipe.rows)
        self._harm("final" if final else "checkpoint")
        files: list[Any] = [None] * self.world_size
        dist.all_gather_object(files, {name: digest})
        self._harm("finished", final)
        return {part: found for written in files for part, found in written.items()}

    def restore_state(self, state: Mapping[str, Any] | SavedModel) -> None:
        """This rank's range of a full state, or of the parts any number of ranks wrote."""
        if isinstance(state, SavedModel):
            table, rows = read_parts(state.folder, state.files)
        else:
            table, rows = state["table"], int(state["rows"])
        if len(table) != self.recipe.rows:
            raise ValueError(f"a model of {len(table)} rows restored into one of "
                             f"{self.recipe.rows}")
        self.table.copy_(table[self.start:self.stop])
        self.model_rows = rows

    def final(self, state: Mapping[str, Any]) -> CountingModel:
        self._harm("finished")
        model = CountingModel(self.recipe.rows, 0.0)
        model.table[:, 0] = state["table"]
        return model

    def plan_summary(self) -> Mapping[str, str]:
        return {"t": f"row ranges over {self.world_size} ranks"}

    def state_bytes(self) -> int:
        """The whole model's bytes: the table and the count of rows trained."""
        return self.recipe.rows * 4 + 8

    def _harm(self, point: str, due: bool = True) -> None:
        """The recipe's harm, if it is ``point``'s on this rank and ``due``, the model holds
        its rows, the job has a complete checkpoint, and no process of the run did it yet."""
        harm = self.recipe.harm
        folder = Path(self.recipe.folder)
        if harm is None or harm.point != point or harm.rank != self.rank or not due \
                or self.model_rows < harm.rows:
            return
        fire_once(folder, {"point": point, "rank": self.rank, "model_rows": self.model_rows,
                           "token": self.token})


def fire_once(folder: Path, where: dict[str, Any]) -> None:
    """The run's harm, ``where`` it says (its ``point``), unless a process of the run did it
    already (the first to create ``folder``'s marker file) or the job has no complete
    checkpoint yet: kill this process, or hang its thread for ever (``hang``)."""
    if (folder / MARKER).exists() \
            or not any((folder / "checkpoints").glob("*/v*/MANIFEST.json")):
        return
    try:
        marker = os.open(folder / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return
    os.write(marker, json.dumps({**where, "pid": os.getpid()}).encode())
    os.close(marker)
    if where["point"] == "hang":
        threading.Event().wait()
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class FinishingHooks(AuditHooks):
    """:class:`~pipeline.bench.chaos_run.AuditHooks` whose ``finish`` kills its worker the first
    time it is handed the final model (the ``finishing`` scenario): ``job_folder`` holds the
    run's marker."""

    job_folder: str = ""

    def finish(self, run: Mapping[str, Any], trainer: CountingModel | None,
               report: Mapping[str, Any]) -> dict[str, Any]:
        if trainer is not None:
            fire_once(Path(self.job_folder), {"point": "finishing", "rank": 0})
        return super().finish(run, trainer, report)


@dataclass(frozen=True)
class CountingShardsRecipe:
    """Builds a :class:`CountingShards` on a rank that joined its job's group: ``rows`` rows
    trained ``epochs`` times; ``folder`` the job's (its step logs, harm marker and
    checkpoints); ``parts``: the model is never gathered, but written in parts."""

    rows: int
    epochs: int
    folder: str
    parts: bool = False
    harm: Harm | None = None
    step_s: float = STEP_S

    def __call__(self, device: torch.device) -> CountingShards:
        return CountingShards(self)


def trained_rows(folder: Path) -> int:
    """The rows the job whose folder is ``folder`` trained, by its ranks' step logs: the sum of
    every distinct (token, step)'s rows."""
    steps: dict[tuple[str, int], int] = {}
    for log in sorted((folder / STEPS).glob("*.log")):
        for line in log.read_text().splitlines():
            token, step, rows = line.split()
            steps[token, int(step)] = max(steps.get((token, int(step)), 0), int(rows))
    return sum(steps.values())


# ---- one run ----------------------------------------------------------------------------------


@dataclass
class SyncJob:
    """One synchronous job of a run: its id, its folder (step logs, harm marker, checkpoints,
    the final model's counts), its data's, and its size."""

    job_id: str
    folder: Path
    data: Path
    rows: int
    seed: int
    parts: bool

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.groups = write_data(self.data, self.rows)
        self.total = self.rows * EPOCHS
        self.checkpoints = checkpoints.job_folder(str(self.folder / "checkpoints"), self.job_id)

    def spec(self, harm: Harm | None, faults: dict[int, dict[str, Any]] | None = None,
             checkpoint_every: str | None = None, resume: str | None = None) -> JobSpec:
        plan = JobPlan(name=f"chaos-sync-{self.job_id}", row_groups=self.groups,
                       batch_rows=WORLD * LOCAL_ROWS, shard_rows=SHARD_ROWS, mode="sync",
                       adaptive_batch=False, epochs=EPOCHS, seed=self.seed,
                       faults=faults or {}, preload=[__name__],
                       checkpoint_dir=str(self.folder / "checkpoints"),
                       checkpoint_every=checkpoint_every or str(self.total // CHECKPOINTS),
                       resume=resume)
        recipe = CountingShardsRecipe(self.rows, EPOCHS, str(self.folder), self.parts, harm)
        hooks = FinishingHooks(str(self.folder), str(self.folder)) \
            if harm is not None and harm.point == "finishing" else AuditHooks(str(self.folder))
        return JobSpec(plan, JobCode.of(recipe, IdReaderRecipe(), hooks))

    def harmed(self) -> dict[str, Any] | None:
        """Where and when the harm fired (None: it did not)."""
        marker = self.folder / MARKER
        return json.loads(marker.read_text()) if marker.exists() else None

    def checkpointed(self) -> bool:
        """Whether the job has a complete checkpoint."""
        return any(Path(self.checkpoints).glob("v*/MANIFEST.json"))

    def result(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """The job's end (its final ``record``), the audit of its final model, and the rows it
        trained (by its step logs) and trained twice (less ``rows x epochs``: negative for a
        job that did not get to its end) against those its master counts replayed."""
        trained = trained_rows(self.folder)
        twice = trained - self.total
        result: dict[str, Any] = {
            "job_id": self.job_id, "state": record["state"], "error": record.get("error"),
            "finished": record["state"] == "finished", "rows": dict(record["rows"]),
            "rows_replayed": int(record.get("rows_replayed", 0)), "trained": trained,
            "trained_twice": twice, "harm": self.harmed(),
            "refused": dict(record.get("refused") or {})}
        result["replayed_exact"] = result["rows_replayed"] == twice
        model = self.folder / f"{self.job_id}.npy"
        if result["finished"] and model.exists():
            result.update(audit(np.load(model), EPOCHS, record["rows"]))
        else:
            result.update(NOTHING_CHECKED, finished=False)
        return result


class SyncRun(Run):
    """One sync scenario's run: whether its models are written in parts (drawn first from its
    seed), and its job, sized for ``job_s`` seconds of training; ``two-jobs`` has a second
    one."""

    world = WORLD
    """Ranks of the run's job, workers of its cluster."""

    def __init__(self, scenario: str, seed: int, folder: Path, job_s: float) -> None:
        super().__init__(scenario, seed, folder, network_config() if scenario in
                         PARTITION_SCENARIOS else SYNC_CONFIG)
        self.partitions = 0
        self.heal: str | None = None
        """When ``partition`` healed its cut (:data:`~pipeline.bench.chaos_partitions.HEALS`)."""
        self.generation = 0
        """The last generation of the job's group (a partition's run: 1, it never formed again;
        0, never formed)."""
        self.stale_refused = 0
        """Stale calls of the job's ranks the scheduler refused (the partitions' runs count)."""
        self.parts = self.rng.random() < 0.5 and scenario != "finishing"
        rows = int(job_s * RATE / EPOCHS)
        self.jobs = [SyncJob(self.job_id, self.folder, self.folder / "data", rows, seed,
                             self.parts)]
        if scenario == "two-jobs":
            self.jobs.append(SyncJob(f"{self.job_id}-second", self.folder / "second",
                                     self.folder / "data" / "second", rows, seed + 1,
                                     self.parts))

    def gate(self, share: float, event: str) -> dict[int, dict[str, Any]]:
        """The faults of the initial ranks: each pauses, holding no lease, once it trained its
        part of ``share`` of the job's rows (all epochs), until the Dask Event ``event``."""
        after = int(share * self.jobs[0].total / WORLD)
        return {rank: {"pause_until": event, "pause_after_rows": after} for rank in range(WORLD)}

    def threshold(self, point: str, share: float) -> int:
        """The rows the model must hold before the harm at ``point``: past the gate's share
        (mid-step, before-commit, hang), none (the first step of two leases, the first
        checkpoint once one is complete), the job's rows (final, finished)."""
        total = self.jobs[0].total
        if point in ("mid-step", "before-commit", "hang"):
            return int(self.rng.uniform(share, 0.8) * total)
        return total if point in ("final", "finished") else 0


def trainer_harm(run: SyncRun) -> list[dict[str, Any]]:
    """The scenarios whose harm is the trainer's: the ranks held until the job has a complete
    checkpoint (``checkpoint``: until the harm, the checkpoints by time), then let go."""
    job, point = run.jobs[0], run.scenario
    share = run.rng.uniform(0.2, 0.4)
    harm = Harm(point, run.rng.randrange(WORLD), run.threshold(point, share))
    processes, _ = run.cluster(WORLD)
    with processes, JobClient(processes.address) as jobs:
        jobs.submit(job.spec(harm, run.gate(share, run.released),
                             "1s" if point == "checkpoint" else None), job_id=job.job_id)
        if point == "checkpoint":
            run.until(jobs, job.harmed, "the harm in a checkpoint")
        else:
            run.until(jobs, job.checkpointed, "a complete checkpoint")
        run.release(jobs)
        return [run.end(jobs)]


def after_manifest(run: SyncRun) -> list[dict[str, Any]]:
    job = run.jobs[0]
    processes, commands = run.cluster(WORLD)
    with processes, JobClient(processes.address) as jobs:
        jobs.submit(job.spec(None, run.gate(run.rng.uniform(0.2, 0.4), run.released)),
                    job_id=job.job_id)
        if run.until(jobs, job.checkpointed, "a complete checkpoint", poll_s=0.02):
            run.kill_process(processes, run.rng.choice(commands))
        run.release(jobs)
        return [run.end(jobs)]


def noted(folder: str, trained: int) -> bool:
    """Whether the job in checkpoint folder ``folder`` has a complete checkpoint and its
    master's last progress note counts ``trained`` rows (every row its held ranks trained)."""
    note = checkpoints.read_note(folder)
    return checkpoints.latest(folder, ignore) is not None and note is not None \
        and int(note["rows"]["trained"] or 0) >= trained


def scheduler(run: SyncRun) -> list[dict[str, Any]]:
    # the ranks are held at 30-60% of the rows, for ever: a checkpoint is due before (at 40-80%
    # of the rows they train), so the rows past it are trained again
    job = run.jobs[0]
    share = run.rng.uniform(0.3, 0.6)
    every = str(int(share * job.total * run.rng.uniform(0.4, 0.8)))
    spec = job.spec(None, run.gate(share, f"{run.job_id}-never"), every)
    processes, _ = run.cluster(WORLD)
    with processes:
        with JobClient(processes.address) as jobs:
            watch = Watch(jobs, job.job_id)
            jobs.submit(spec, job_id=job.job_id)
            if not run.until(jobs, lambda: len(watch.paused()) == WORLD, "every rank held"):
                return [run.end(jobs)]  # it failed
        # a held rank reported every row it trained before it paused: the note then counts them
        processes.kill_when(lambda: noted(job.checkpoints, watch.paused_rows()),
                            "a note of every row trained", WAIT_S)
        run.kills += 1
    manifest = checkpoints.latest(job.checkpoints, ignore)
    assert manifest is not None, "the kill came after a complete checkpoint"
    done = manifest.rows["trained"]
    harm = Harm("mid-step", run.rng.randrange(WORLD),
                int(done + run.rng.uniform(0.1, 0.6) * (job.total - done)))
    processes, _ = run.cluster(WORLD)
    with processes, JobClient(processes.address) as jobs:
        jobs.submit(job.spec(harm, {}, every, resume=manifest.path), job_id=job.job_id)
        return [run.end(jobs)]


def two_jobs(run: SyncRun) -> list[dict[str, Any]]:
    first, second = run.jobs
    share = run.rng.uniform(0.2, 0.4)
    harm = Harm("mid-step", run.rng.randrange(WORLD), run.threshold("mid-step", share))
    processes, _ = run.cluster(WORLD)
    with processes, JobClient(processes.address) as jobs:
        jobs.submit(first.spec(harm, run.gate(share, run.released)), job_id=first.job_id)
        jobs.submit(second.spec(None), job_id=second.job_id)
        run.until(jobs, first.checkpointed, "a complete checkpoint of the first job")
        run.release(jobs)
        return [run.end(jobs), run.end(jobs, second.job_id)]


SYNC_RUNNERS: dict[str, Callable[[SyncRun], list[dict[str, Any]]]] = {
    "mid-step": trainer_harm, "before-commit": trainer_harm, "two-leases": trainer_harm,
    "checkpoint": trainer_harm, "after-manifest": after_manifest, "final": trainer_harm,
    "finished": trainer_harm, "finishing": trainer_harm, "hang": trainer_harm,
    "scheduler": scheduler, "two-jobs": two_jobs, **PARTITION_RUNNERS}


def refused(jobs: Sequence[Mapping[str, Any]], stale_ranks: int) -> dict[str, int]:
    """The calls the scheduler refused, by kind: the jobs' records' (summed), and the stale
    ranks' (``sync_rank``, read from the rendezvous) where the records do not count them."""
    kinds: dict[str, int] = {}
    for job in jobs:
        for kind, count in job["refused"].items():
            kinds[kind] = kinds.get(kind, 0) + int(count)
    if stale_ranks:
        kinds.setdefault("sync_rank", stale_ranks)
    return kinds


def run_sync(scenario: str, seed: int, folder: Path, job_s: float) -> dict[str, Any]:
    """One run of the sync ``scenario``: its job(s) on fresh clusters, the harm, and for every
    job the audit of its final model and its replays; the run's figures are its jobs' (summed;
    ``finished`` and ``replayed_exact`` when every job's is; the first unfinished job's state
    and error), each job's, with its ledger's counters, under ``jobs``."""
    started = time.monotonic()
    run = SyncRun(scenario, seed, folder, job_s)
    try:
        records = SYNC_RUNNERS[scenario](run)
    except TimeoutError as exc:  # a wait of the run's own: reported with the run, unfinished
        records = [{"state": "timed out", "error": str(exc), "rows": {}} for _ in run.jobs]
    jobs = [job.result(record) for job, record in zip(run.jobs, records)]
    harms = [job["harm"] for job in jobs if job["harm"] is not None]
    failed = next((job for job in jobs if not job["finished"]), jobs[0])
    result: dict[str, Any] = {
        "mode": "sync", "scenario": scenario, "seed": seed, "job_id": run.job_id,
        "parts": run.parts, "state": failed["state"], "error": failed["error"],
        "finished": all(job["finished"] for job in jobs),
        "kills": run.kills + sum(harm["point"] != "hang" for harm in harms),
        "hangs": run.hangs + sum(harm["point"] == "hang" for harm in harms),
        "replayed_exact": all(job["replayed_exact"] for job in jobs),
        "replay_mismatches": sum(job["finished"] and not job["replayed_exact"] for job in jobs),
        "partitions": run.partitions, "heal": run.heal, "generation": run.generation,
        "stale_refused": run.stale_refused, "refused": refused(jobs, run.stale_refused),
        "seconds": round(time.monotonic() - started, 1), "jobs": jobs}
    for key in ("rows_replayed", "trained_twice", *NOTHING_CHECKED):
        result[key] = sum(job[key] for job in jobs)
    return result
