"""`antdt bench chaos`: antdt's first promise, checked on the model itself while workers die.

The promise: every row of every epoch ends trained, its effect in the final model exactly once
(per epoch), or counted as quarantined or lost; a row whose first effect was lost with a worker
is trained again and counted (``rows_retrained``, a cost, not an error). The ledger's counters
are tested elsewhere against the offsets they are computed from; this holds the final model
against them.

Each run trains a job on real ``dask scheduler`` and ``dask worker`` processes (the real
agents, ledger, controller, model sync and checkpoints) with a model that counts (row ``i`` of
its one embedding table grows by 1 each time row ``i`` of the Parquet data is trained), does
harm at moments drawn from the seed, and checks that every row the ledger counts done is in the
final model exactly ``epochs`` times (:func:`~pipeline.bench.chaos_run.audit`): a row with
another count is a discrepancy. ``--mode`` picks the training mode of the jobs: ``async`` (this
module's scenarios, with :class:`~pipeline.bench.chaos_run.CountingModel` as every worker's
replica, the model sync moving its counts like any embedding update), ``sync`` (one model
sharded over the ranks; its scenarios, and what else a sync run checks, are
:mod:`pipeline.bench.chaos_sync`'s), ``hybrid`` (the async mode with the table sharded over the
workers, :class:`~pipeline.bench.chaos_run.CountingTables` the trainer: every worker trains and
hosts buckets of the table, each with a backup on another worker), or ``all``, the three in
alternation.

Async scenarios (each on a fresh cluster):

* ``kill``       three workers; twice, at a random share of the job, one is killed: its worker
                 process alone (SIGKILL; its nanny starts a new one, which joins the job) or
                 together with its nanny (a new worker command joins instead);
* ``hang``       three workers; one stops training after a random number of rows (its sync
                 goes on); the controller revokes its lease and retires it;
* ``lone``       two workers; one is killed with its nanny, the other trains alone up to its
                 gate, a new worker joins from its model, and the lone one is killed the moment
                 the joiner has trained its first batch;
* ``scheduler``  two workers, a checkpoint every second; at a random share of the job the
                 scheduler and every worker are killed, at a moment when the job's newest
                 complete checkpoint held rows in flight (trained, not yet synced: counted
                 retrained) and its master had noted rows trained past it (counted replayed);
                 the job resumes from that checkpoint on a new cluster (as ``--resume`` does),
                 where one more worker process is killed.

Network scenarios (``partition``, ``peer-partition``, ``scheduler-partition``: links cut, not
processes killed, on a cluster of hosts in network namespaces, which needs root; run by default
only where namespaces can be made): :mod:`pipeline.bench.chaos_net`. A run reports the stale
calls the scheduler refused from workers it had removed (``refused``, by kind) and, of a
partition, when it healed (``heal``).

Hybrid scenarios (the final table gathered from its hosts):

* ``host-kill``  ``kill`` on a job whose workers host the table: a killed worker's buckets are
                 served by their backups, the job goes on without a restart; each kill waits
                 until every bucket has a backup on a live worker (the first kill's buckets are
                 backed up again before the second: two holders lost at once would lose a
                 bucket, which only a resume from a checkpoint survives);
* ``host-hang``  ``hang`` on such a job: the hung worker's handlers go on serving its buckets
                 until the controller retires it.

No harm waits on the job lasting long enough, however slow the machine (a joiner's start takes
seconds of imports on two busy cores): every moment a run waits for (a share of the rows, a
pause, a hang, a joiner's first batch, a checkpoint worth losing) is one the job cannot end
before. The initial workers are gated by an injected pause (:class:`~antdt.agent.Faults`
``pause_until``): past a share of the rows that leaves the rest of the job undone, each waits,
holding no lease, for a Dask ``Event`` set once the harm is done (or is killed itself), and the
job does not end while one of them waits. A joiner has no gate, so the workers that replace the
killed ones join only once the kills that must come before the end are made: a killed worker's
nanny is stopped meanwhile (SIGSTOP), and a new worker command starts then. The scheduler
scenario stops the scheduler (SIGSTOP: its master writes the checkpoints' manifests and the
progress notes) before it reads them and kills the cluster, so nothing the resumed job reads can
change between the check and the kill (a worker may be writing a newer checkpoint's files: no
manifest, so that version is torn and skipped); when the check fails, the scheduler goes on
until the next note.

``--seconds`` bounds the run: the scenarios follow each other in that order, again and again,
until the time is spent (each at least once; with ``--mode all`` an async, a sync and a
hybrid run in turn). The JSON reports, in all and per scenario (a sync scenario as
``sync/<name>``: two names are in both modes), the runs, the kills and hangs made, the rows checked (rows x epochs),
the discrepancies found, the sync runs' replay mismatches and the hybrid runs' restarts from a
checkpoint (``hybrid_resumes``; target: 0 each), and every run's mode, seed, counters, resumes
and seconds. The command exits 1 on a discrepancy, a job that did not finish, a replay
mismatch or a hybrid job's restart.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

from antdt.jobs import JobClient, JobCode, JobPlan, JobSpec, checkpoints
from antdt.jobs.client import FINAL
from pipeline.bench import emit
from antdt.tables.service import PLUGIN_NAME as TABLES_PLUGIN
from pipeline.bench.chaos_run import (EPOCHS, NOTHING_CHECKED, STEP_S, WAIT_S, AuditHooks,
                                      CountingModel, CountingTables, IdReaderRecipe, Run, Watch,
                                      audit, ignore, write_data)
from pipeline.bench.chaos_net import NETWORK_RUNNERS, NETWORK_SCENARIOS
from pipeline.bench.chaos_sync import SYNC_SCENARIOS, run_sync
from pipeline.bench.jobs import echo
from pipeline.bench.network import namespaces_available
from pipeline.bench.processes import freeze, thaw

SCENARIOS = ("kill", "hang", "lone", "scheduler", *NETWORK_SCENARIOS)
HYBRID_SCENARIOS = ("host-kill", "host-hang")
MODE_SCENARIOS = {"async": SCENARIOS, "sync": SYNC_SCENARIOS, "hybrid": HYBRID_SCENARIOS}
MODES = {"async": ("async",), "sync": ("sync",), "hybrid": ("hybrid",),
         "all": ("async", "sync", "hybrid")}
"""``--mode``: the modes whose scenarios run, in the order they alternate."""
BATCH_ROWS = 64

CONFIG = {"antdt": {
    "monitor": {"window": "1s", "hang-floor": "2s"},
    "controller": {"policies": [
        {"class": "antdt.controller.RevokeHung"},
        {"class": "antdt.controller.RetireHung", "after_s": 3},
        {"class": "antdt.controller.ReassignStragglers"},
        {"class": "antdt.controller.PaceStragglers"},
        {"class": "antdt.controller.SplitTail"}]},
    "sharding": {"no-workers-timeout": "60s"},
    "sync": {"join-timeout": "60s", "final-timeout": "120s"},
    "jobs": {"tick": "200ms", "allow-faults": True},  # the runs inject faults (pauses, hangs)
}, "logging": {"antdt.controller": "info"}}
"""Dask config of every process of an async (or hybrid) run: a hung worker is retired within
seconds, not 30 (each retirement logged with its evidence); the master notes the job's progress
five times a second, so a checkpoint (one a second) is followed by several notes of rows
trained past it before the next one (the scheduler scenario's kill waits for one)."""


@dataclass(frozen=True)
class CountingRecipe:
    """Builds a :class:`~pipeline.bench.chaos_run.CountingModel` on a worker."""

    rows: int
    step_s: float = STEP_S

    def __call__(self, device: torch.device) -> CountingModel:
        return CountingModel(self.rows, self.step_s)

    def remote_tables(self, device: torch.device) -> CountingTables:
        return CountingTables(self.rows, self.step_s)


class AsyncRun(Run):
    """One async scenario's run: its data, sized for ``job_s`` seconds of training on three
    workers, and its job; with ``sharded``, the job's table is sharded over its workers (the
    hybrid mode)."""

    def __init__(self, scenario: str, seed: int, folder: Path, job_s: float,
                 sharded: bool = False, heal: str | None = None) -> None:
        super().__init__(scenario, seed, folder, CONFIG)
        self.sharded = sharded
        self.heal = heal
        """When a network scenario healed its cut (:mod:`~pipeline.bench.chaos_net`; None:
        drawn from the seed)."""
        # three workers at half the steps' pace (commits, sync rounds and the cluster share two
        # cores), over the epochs
        self.rows = int(job_s * 3 * BATCH_ROWS / STEP_S / 2 / EPOCHS)
        self.groups = write_data(self.folder / "data", self.rows)

    def gate(self, share: float, event: str) -> dict[str, Any]:
        """The faults of an initial worker that pauses, holding no lease, once it trained
        ``share`` of the job's rows (all epochs), until the Dask Event ``event`` is set."""
        return {"pause_until": event, "pause_after_rows": int(share * self.rows * EPOCHS)}

    def spec(self, checkpoint_every: str | None = None,
             faults: dict[int, dict[str, Any]] | None = None,
             workers: int | None = None) -> JobSpec:
        plan = JobPlan(name=f"chaos-{self.scenario}", row_groups=self.groups,
                       batch_rows=BATCH_ROWS, shard_rows=16 * BATCH_ROWS, epochs=EPOCHS,
                       seed=self.seed, faults=faults or {}, workers=workers,
                       preload=[__name__],
                       checkpoint_dir=str(self.folder / "checkpoints"),
                       checkpoint_every=checkpoint_every or "2s",
                       tables=self.tables() if self.sharded else None)
        return JobSpec(plan, JobCode.of(CountingRecipe(self.rows), IdReaderRecipe(),
                                        AuditHooks(str(self.folder))))

    def tables(self) -> dict[str, Any]:
        """The plan's sharded table: one count a row, SGD with lr 1 (a gradient of -1 adds 1),
        in buckets of about a sixth of a worker's share, so every host serves several."""
        return {"placement": "sharded", "total_rows": self.rows, "dim": 1, "optimizer": "sgd",
                "lr": 1.0, "eps": 1e-8, "buckets_per_worker": 6, "bucket_rows": 1,
                "max_inflight": 2}

    def backed_up(self, jobs: JobClient, hosts: int) -> bool:
        """Whether the job's table is held by ``hosts`` live workers (a killed one is out of
        its map), every bucket with a primary and a backup, no change of its map under way: a
        kill now loses no bucket."""
        return bool(jobs.client.run_on_scheduler(_backed_up, job=self.job_id, hosts=hosts))

    def at_share(self, jobs: JobClient, share: float) -> dict[str, Any]:
        """The job's record once it trained ``share`` of its rows (or ended)."""
        target = share * self.rows * EPOCHS
        record = jobs.status(self.job_id)
        deadline = time.monotonic() + WAIT_S
        while record["rows"].get("trained", 0) < target and record["state"] not in FINAL:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.job_id} did not reach {target:.0f} rows trained")
            record = jobs.wait(self.job_id, record["version"], timeout_s=1.0)
        return record


def _backed_up(job: str, hosts: int, dask_scheduler: Any) -> bool:
    service = dask_scheduler.plugins[TABLES_PLUGIN]
    current, lock = service.maps.get(job), service._locks.get(job)
    if current is None or service._tasks or (lock is not None and lock.locked()):
        return False
    holders = current.workers()
    return len(holders) == hosts and holders <= set(dask_scheduler.workers) \
        and None not in current.backup and not current.lost


def kill(run: AsyncRun) -> dict[str, Any]:
    # each of the three trains at most 30% of the rows before the kills are made (the second
    # comes by 55%: the two left reach it); the killed ones are replaced only then
    gate = run.gate(0.3, run.released)
    processes, commands = run.cluster(3)
    with processes, JobClient(processes.address) as jobs:
        jobs.submit(run.spec(faults={index: gate for index in range(3)}), job_id=run.job_id)
        intact, held, replaced = list(commands), [], 0
        for share in sorted(run.rng.uniform(0.1, 0.55) for _ in range(2)):
            if run.at_share(jobs, share)["state"] in FINAL:
                return run.end(jobs)  # it failed
            # sharded: the victim hosts buckets; their backups serve them once it is gone, and
            # the first kill's buckets are backed up again before the second
            if run.sharded and not run.until(jobs, lambda: run.backed_up(jobs, len(intact)),
                                             "every bucket backed up"):
                return run.end(jobs)  # it failed
            victim = intact.pop(run.rng.randrange(len(intact)))
            if run.rng.random() < 0.5:
                freeze(victim.pid)  # its nanny replaces the worker once the kills are made
                held.append(victim)
                run.kill_process(processes, victim)
            else:
                run.kill_command(processes, commands, victim)
                replaced += 1
        for nanny in held:
            thaw(nanny.pid)
        commands += [processes.add_workers(1) for _ in range(replaced)]
        run.release(jobs)
        return run.end(jobs)


def hang(run: AsyncRun) -> dict[str, Any]:
    # the hung one stops after 3% to 17% of the rows; the other two train at most 30% each
    # before it hangs, so it gets its rows
    hung = run.rng.randrange(3)
    after = int(run.rng.uniform(0.1, 0.5) * run.rows * EPOCHS / 3)
    faults = {index: run.gate(0.3, run.released) for index in range(3) if index != hung}
    processes, _ = run.cluster(3)
    with processes, JobClient(processes.address) as jobs:
        watch = Watch(jobs, run.job_id)
        jobs.submit(run.spec(faults={**faults, hung: {"hang_after_rows": after}}),
                    job_id=run.job_id)
        if run.until(jobs, watch.hung, "a worker to hang"):
            run.hangs += 1
        run.release(jobs)
        return run.end(jobs)


def lone(run: AsyncRun) -> dict[str, Any]:
    # either of the two may be left alone: each trains at most 40% of the rows (the other has
    # trained under 30% when it dies), then waits for an event nobody sets: the lone one, once
    # paused there, waits until the joiner trained, and is killed
    gate = run.gate(0.4, f"{run.job_id}-never")
    processes, commands = run.cluster(2)
    with processes, JobClient(processes.address) as jobs:
        watch = Watch(jobs, run.job_id)
        jobs.submit(run.spec(workers=2, faults={0: gate, 1: gate}), job_id=run.job_id)
        if run.at_share(jobs, run.rng.uniform(0.1, 0.3))["state"] in FINAL:
            return run.end(jobs)  # it failed
        training = {agent["worker"] for agent in jobs.status(run.job_id)["agents"]}
        lone, victim = run.rng.sample(sorted(training), 2)
        last = run.command_of(jobs, processes, commands, lone)
        run.kill_command(processes, commands, run.command_of(jobs, processes, commands, victim))
        # alone up to its gate; then a new worker joins from its model; gone once it trained
        if run.until(jobs, lambda: lone in watch.paused(), "the lone worker's pause"):
            commands.append(processes.add_workers(1))
            if run.until(jobs, lambda: watch.trained() - training, "the joiner's first batch"):
                run.kill_command(processes, commands, last)
        return run.end(jobs)


def worth_losing(folder: str) -> bool:
    """Whether the job in checkpoint folder ``folder``, lost now, costs what the scheduler
    scenario checks: its newest complete checkpoint held rows in flight (trained, not yet
    synced: the resumed job trains them again, counted retrained) and its master's last
    progress note counts rows trained past that checkpoint (trained again, counted replayed).
    Both are files the master writes: read while it is stopped, they are what the resumed job
    reads."""
    manifest = checkpoints.latest(folder, ignore)
    note = checkpoints.read_note(folder)
    if manifest is None or note is None:
        return False
    rows = manifest.rows
    in_flight = rows["trained"] - rows["done"] - rows["retrained"]
    return in_flight > 0 and int(note["rows"]["trained"] or 0) > rows["trained"]


def scheduler(run: AsyncRun) -> dict[str, Any]:
    # each trains at most 40% of the rows, then waits for an event nobody sets: the cluster is
    # killed first
    gate = run.gate(0.4, f"{run.job_id}-never")
    spec = run.spec(checkpoint_every="1s", faults={0: gate, 1: gate})
    assert spec.plan.checkpoint_dir is not None
    folder = checkpoints.job_folder(spec.plan.checkpoint_dir, run.job_id)
    processes, _ = run.cluster(2)
    with processes:
        with JobClient(processes.address) as jobs:
            jobs.submit(spec, job_id=run.job_id)
            record = run.at_share(jobs, run.rng.uniform(0.3, 0.7))
            if record["state"] in FINAL:
                return record  # it failed
        # the scheduler and every worker, at once, the scheduler stopped since the check
        processes.kill_when(lambda: worth_losing(folder), "a checkpoint worth losing", WAIT_S)
        run.kills += 1
    manifest = checkpoints.latest(folder, ignore)  # a newer one torn by the kill is skipped
    assert manifest is not None, "the kill came after a complete checkpoint"
    done = manifest.rows["trained"] / (run.rows * EPOCHS)
    # each worker trains at most a quarter of the rest, then waits until the kill, which comes
    # at 10% to 40% of the rest
    gate = run.gate((1 - done) / 4, run.released)
    processes, commands = run.cluster(2)
    with processes, JobClient(processes.address) as jobs:
        jobs.submit(dataclasses.replace(spec, plan=dataclasses.replace(
            spec.plan, resume=manifest.path, faults={0: gate, 1: gate})), job_id=run.job_id)
        share = done + (1 - done) * run.rng.uniform(0.1, 0.4)
        if run.at_share(jobs, share)["state"] in FINAL:
            return run.end(jobs)  # it failed
        run.kill_process(processes, run.rng.choice(commands))
        run.release(jobs)
        return run.end(jobs)


RUNNERS: dict[str, Callable[[AsyncRun], dict[str, Any]]] = {
    "kill": kill, "hang": hang, "lone": lone, "scheduler": scheduler,
    "host-kill": kill, "host-hang": hang, **NETWORK_RUNNERS}


def run_scenario(scenario: str, seed: int, folder: Path, job_s: float,
                 mode: str = "async", heal: str | None = None) -> dict[str, Any]:
    """One run of the async or hybrid ``scenario``: its job on fresh clusters, the harm, and
    :func:`~pipeline.bench.chaos_run.audit` of its final model (``finished`` False, and nothing
    checked, when the job did not finish). ``heal``: a network scenario's (else drawn)."""
    started = time.monotonic()
    run = AsyncRun(scenario, seed, folder, job_s, sharded=mode == "hybrid", heal=heal)
    try:
        record = RUNNERS[scenario](run)
    except TimeoutError as exc:  # a wait of the run's own: reported with the run, unfinished
        record = {"state": "timed out", "error": str(exc), "rows": {}}
    result: dict[str, Any] = {
        "mode": mode, "scenario": scenario, "seed": seed, "job_id": run.job_id,
        "state": record["state"], "error": record.get("error"),
        "finished": record["state"] == "finished", "kills": run.kills, "hangs": run.hangs,
        "rows": dict(record["rows"]), "rows_replayed": record.get("rows_replayed", 0),
        "resumes": record.get("resumes", 0), "refused": record.get("refused", {}),
        "heal": run.heal, "seconds": round(time.monotonic() - started, 1)}
    model = folder / f"{run.job_id}.npy"
    if result["finished"] and model.exists():
        result.update(audit(np.load(model), EPOCHS, record["rows"]))
    else:
        result.update(NOTHING_CHECKED, finished=False)
    return result


def chaos(seconds: float, seed: int, folder: Path, scenarios: Sequence[str] | None = None,
          job_s: float = 8.0, quiet: bool = True, mode: str = "async") -> dict[str, Any]:
    """Runs of ``scenarios`` (None: every scenario) of ``mode``'s modes in turn until
    ``seconds`` passed (each at least once), in ``folder``; their totals, per scenario and in
    all, and every run (see the module)."""
    started = time.monotonic()
    networked = namespaces_available() is None  # else the network scenarios run if named
    plan = {m: [s for s in scenarios or MODE_SCENARIOS[m] if s in MODE_SCENARIOS[m]
                and (scenarios or networked or s not in NETWORK_SCENARIOS)]
            for m in MODES[mode]}
    modes = [m for m in MODES[mode] if plan[m]]
    runs: list[dict[str, Any]] = []
    rng = random.Random(seed)
    ran = dict.fromkeys(modes, 0)
    while any(ran[m] < len(plan[m]) for m in modes) or time.monotonic() - started < seconds:
        m = modes[len(runs) % len(modes)]
        scenario = plan[m][ran[m] % len(plan[m])]
        ran[m] += 1
        if m != "sync":
            where = folder / f"run-{len(runs)}-{scenario}"
            result = run_scenario(scenario, rng.randrange(2**31), where, job_s, mode=m)
        else:
            where = folder / f"run-{len(runs)}-sync-{scenario}"
            result = run_sync(scenario, rng.randrange(2**31), where, job_s)
        runs.append(result)
        shutil.rmtree(where / "data", ignore_errors=True)
        replays = "" if m != "sync" else \
            f", {result['rows_replayed']:,} rows replayed of {result['trained_twice']:,} " \
            "trained twice"
        echo(f"{label(result)}: {result['state']}, {result['kills']} kill(s), "
             f"{result['hangs']} hang(s), {result['rows_checked']:,} rows checked, "
             f"{result['discrepancies']} discrepancies{replays} ({result['seconds']:.0f}s)",
             quiet)
    totals = _totals(runs)
    return {"seconds": round(time.monotonic() - started, 1), "seed": seed, **totals,
            "by_scenario": {name: _totals([r for r in runs if label(r) == name])
                            for name in dict.fromkeys(label(r) for r in runs)},
            "runs": runs}


def label(run: Mapping[str, Any]) -> str:
    """A run's scenario as the totals name it: ``sync/<name>`` for a sync run's."""
    return run["scenario"] if run["mode"] != "sync" else f"sync/{run['scenario']}"


def _totals(runs: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    return {"scenarios_run": len(runs), "unfinished": sum(not r["finished"] for r in runs),
            **{key: sum(int(r[key]) for r in runs)
               for key in ("kills", "hangs", "rows_checked", "discrepancies", "missing",
                           "extra")},
            "replay_mismatches": sum(r["replay_mismatches"] for r in runs if r["mode"] == "sync"),
            "refused": sum(sum(r.get("refused", {}).values()) for r in runs),
            "hybrid_resumes": sum(r["resumes"] for r in runs if r["mode"] == "hybrid")}


@click.command("chaos")
@click.option("--seconds", type=float, default=120.0, show_default=True,
              help="Run scenarios until this many seconds passed (each at least once).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--mode", type=click.Choice(sorted(MODES)), default="async", show_default=True,
              help="The training mode of the jobs; all: an async, a sync and a hybrid run in "
                   "turn.")
@click.option("--scenario", "scenarios", default=None,
              help="Comma-separated (default: every scenario of the mode), from: async: "
                   + ", ".join(SCENARIOS) + "; sync: " + ", ".join(SYNC_SCENARIOS)
                   + "; hybrid: " + ", ".join(HYBRID_SCENARIOS) + ".")
@click.option("--job-s", type=float, default=8.0, show_default=True,
              help="About how long one job trains on three workers, unharmed.")
@click.option("--folder", type=click.Path(file_okay=False), default=".antdt-bench/chaos",
              show_default=True, help="Where the runs' data, clusters and models go (emptied).")
@click.option("--json", "as_json", is_flag=True)
def command(seconds: float, seed: int, mode: str, scenarios: str | None, job_s: float,
            folder: str, as_json: bool) -> None:
    """Kill workers and schedulers at random moments; check the final model against the
    ledger: every row it counts done in the model exactly once per epoch (and, of a sync job,
    the rows its ranks trained twice are the rows its master counts replayed)."""
    known = {s for m in MODES[mode] for s in MODE_SCENARIOS[m]}
    chosen = None if scenarios is None else [s.strip() for s in scenarios.split(",")
                                             if s.strip()]
    if chosen is not None and (not chosen or set(chosen) - known):
        raise click.UsageError(f"--scenario: expected some of {', '.join(sorted(known))} "
                               f"(--mode {mode}), found {scenarios!r}")
    shutil.rmtree(folder, ignore_errors=True)
    result = chaos(seconds, seed, Path(folder), chosen, job_s, quiet=as_json, mode=mode)
    emit(result, as_json)
    if result["discrepancies"] or result["unfinished"] or result["replay_mismatches"] \
            or result["hybrid_resumes"]:
        raise SystemExit(1)
