"""`antdt bench chaos --mode sync`'s partitions: a synchronous job (:mod:`pipeline.bench.
chaos_sync`'s counting model, audited on its final model as every sync run is) on a cluster of
hosts (:class:`~pipeline.bench.network.NetworkCluster`: the scheduler and each worker in a
network namespace of its own), whose links are cut while every rank is in its steps' collectives,
then healed. The comm timeouts are short (:data:`NETWORK_ENV`): a dead link is found in seconds.

* ``partition``            one worker cut from everyone, silently (its link stays up, nothing
                           answers it), healed at a moment drawn from the seed (:data:`HEALS`):
                           the group's collectives break at the collective timeout, the master
                           forms the group again without it from the last checkpoint (as on a
                           death), and the job finishes on the others. Healed when dropped,
                           the worker was stalled from the cut (its process stopped, as by a
                           paused VM: otherwise it notices the dead link and closes itself
                           first) and wakes after the heal (:func:`~pipeline.bench.chaos_net.
                           zombie`): its rank of the old forming asks about its forming and is
                           refused and counted (``stale_refused``);
* ``peer-partition``       one worker cut from its peers only until the master formed the group
                           again, then healed: every rank's collective breaks (a rank cannot tell
                           a peer cut from itself cut), the scheduler still reaches them all, so
                           the group forms again with every worker, once the link is back;
* ``scheduler-partition``  every worker cut from the scheduler, once every rank is held by the
                           gate (each reported every row it trained), until the scheduler
                           dropped them all, then healed: each closed itself (its nanny too) and
                           starts again (as a deployment restarts what exits), and the group
                           forms again from the last checkpoint on the workers back. (Cut while
                           the ranks train, they go on stepping with their peers where the
                           master cannot hear them, and its ``rows_replayed`` is then a lower
                           bound, as after a whole cluster's loss: 8 runs of 8 so, by 640 to
                           1,408 rows, every final model exact.)

The cut comes once the job has a complete checkpoint (``scheduler-partition``: and every rank
is held), while the ranks train or, held by the run's gate
(:meth:`~pipeline.bench.chaos_sync.SyncRun.gate`), take part in empty steps' headers (a
collective every few milliseconds either way); the gate is let go once the group formed again,
so the job cannot end first. No wait is for a duration: each is for what the cluster shows (the
group's generation, the scheduler's workers, a process's exit), bounded by
:data:`~pipeline.bench.chaos_run.WAIT_S`.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

from antdt.jobs import JobClient
from antdt.jobs.spec import PLUGIN_NAME as JOBS_PLUGIN
from pipeline.bench.chaos_net import zombie
from pipeline.bench.chaos_run import Watch
from pipeline.bench.network import NetworkCluster

PARTITION_SCENARIOS = ("partition", "peer-partition", "scheduler-partition")
HEALS = ("dropped", "exited")
"""When ``partition`` heals its cut, drawn from the run's seed: the moment the scheduler dropped
the worker (its process may still live: a zombie, whose stale calls are refused), or once its
process exited (then it starts again, a new worker the next forming may take)."""

NETWORK_ENV = {"DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": "11s",
               "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "5s"}
"""A dead link is found in 11 s (TCP's user timeout; Dask refuses less), not Dask's default 30 s."""

NETWORK_CONFIG = {"sync-steps": {"form-timeout": "60s"}}
"""A partitioned run's own ``antdt`` settings: a forming waits a minute for its links (a peer
partition heals meanwhile), and a rank whose group broke asks the scheduler that long whether its
forming is still the job's (a zombie's question is answered once its link heals)."""


def group_state(jobs: JobClient, job_id: str) -> tuple[int, int]:
    """The latest generation of ``job_id``'s synchronous group on the scheduler (0: none yet;
    kept once the job ended) and the stale calls of its ranks refused so far."""
    def read(dask_scheduler: Any, job: str) -> tuple[int, int]:
        rendezvous = dask_scheduler.plugins[JOBS_PLUGIN].rendezvous
        return rendezvous.generations.get(job, 0), rendezvous.refused.get(job, 0)

    generation, refused = jobs.client.run_on_scheduler(read, job=job_id)
    return int(generation), int(refused)


def members(jobs: JobClient) -> set[str]:
    """The workers the scheduler has now."""
    return set(jobs.client.scheduler_info(n_workers=-1)["workers"])


def exited(net: NetworkCluster, worker: int) -> Callable[[], bool]:
    """Whether worker ``worker``'s command (its nanny and worker process) has exited."""
    return lambda: net.worker_commands[worker].poll() is not None


def network(run: Any, workers: int) -> NetworkCluster:
    """A new cluster of ``workers`` hosts for the run (every process with its Dask config and
    :data:`NETWORK_ENV`)."""
    folder = run.folder / f"cluster-{run.clusters}"
    run.clusters += 1
    folder.mkdir()
    return NetworkCluster(folder, workers=workers, env={**run.env, **NETWORK_ENV},
                          allow_faults=True)


def partitioned(run: Any, cut: Callable[[NetworkCluster, JobClient, Watch], None]
                ) -> list[dict[str, Any]]:
    """The run's job on a cluster of hosts, its ranks held until it has a complete checkpoint,
    then ``cut(net, jobs, watch)`` (which heals what it cut; ``watch``: the job's agents'
    events); once the group formed again, the gate let go, and the job's end (the group's last
    generation and the stale calls refused, kept in the run)."""
    job = run.jobs[0]
    with network(run, run.world) as net, JobClient(net.address) as jobs:
        watch = Watch(jobs, job.job_id)
        jobs.submit(job.spec(None, run.gate(run.rng.uniform(0.2, 0.4), run.released)),
                    job_id=job.job_id)
        if run.until(jobs, job.checkpointed, "a complete checkpoint"):
            cut(net, jobs, watch)
            run.until(jobs, lambda: group_state(jobs, job.job_id)[0] > 1,
                      "the group forming again")
        run.release(jobs)
        record = run.end(jobs)
        run.generation, run.stale_refused = group_state(jobs, job.job_id)
        return [record]


def partition(run: Any) -> list[dict[str, Any]]:
    def cut(net: NetworkCluster, jobs: JobClient, watch: Watch) -> None:
        victim = run.rng.randrange(net.count)
        run.heal = HEALS[run.rng.randrange(len(HEALS))]
        address = net.workers[victim]
        pid = jobs.client.run(os.getpid, workers=[address])[address]
        net.cut(victim, from_="scheduler")  # silently: its link stays up, nothing answers
        net.cut(victim, from_="peers")
        if run.heal == "dropped":  # stalled from the cut: it cannot close itself first
            os.kill(pid, signal.SIGSTOP)
        run.partitions += 1
        run.until(jobs, lambda: address not in members(jobs),
                  "the scheduler dropping the cut worker")
        if run.heal == "exited":
            if not run.until(jobs, exited(net, victim), "the cut worker's exit"):
                return  # the job ended first (it failed): the run reports its end
            net.heal(victim)
            net.restart(victim)
        else:
            zombie(net, victim, pid)  # healed, then woken: its rank asks about its forming

    return partitioned(run, cut)


def peer_partition(run: Any) -> list[dict[str, Any]]:
    def cut(net: NetworkCluster, jobs: JobClient, watch: Watch) -> None:
        victim = run.rng.randrange(net.count)
        net.cut(victim, from_="peers")
        run.partitions += 1
        run.until(jobs, lambda: group_state(jobs, run.job_id)[0] > 1, "the group forming again")
        net.heal(victim)

    return partitioned(run, cut)


def scheduler_partition(run: Any) -> list[dict[str, Any]]:
    def cut(net: NetworkCluster, jobs: JobClient, watch: Watch) -> None:
        # every rank held first: a held rank reported every row it trained, so the ledger the
        # master restarts from counts every row the lost group's model held
        run.until(jobs, lambda: len(watch.paused()) == net.count, "every rank held")
        for worker in range(net.count):
            net.cut(worker, from_="scheduler")
        run.partitions += 1
        run.until(jobs, lambda: not members(jobs) & set(net.workers),
                  "the scheduler dropping every worker")
        for worker in range(net.count):
            net.heal(worker)
        for worker in range(net.count):  # each closed itself, its nanny too: started again
            if not run.until(jobs, exited(net, worker), f"worker {worker} closing itself"):
                return  # the job ended first (it failed): the run reports its end
            net.restart(worker)

    return partitioned(run, cut)


PARTITION_RUNNERS: dict[str, Callable[[Any], list[dict[str, Any]]]] = {
    "partition": partition, "peer-partition": peer_partition,
    "scheduler-partition": scheduler_partition}
