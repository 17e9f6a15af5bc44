"""The async chaos runs on a network that fails (``antdt bench chaos --scenario partition,...``):
each run's cluster is a :class:`~pipeline.bench.network.NetworkCluster`, every process a host of
its own, and the harm is done to the links, not the processes. Audited on the final model as
every chaos run is (:mod:`pipeline.bench.chaos`).

Scenarios (three workers, each gated at 30% of the rows as the kill scenario's are):

* ``partition``            one worker is cut from everyone at a random share of the job and
                           healed at one of three moments, drawn from the seed: ``early``, once
                           the others trained on (the master heard of their next rows: before
                           the monitor or TCP notices; it rejoins its work, no restart);
                           ``zombie``, the moment the scheduler removed it (the controller
                           retires it as hung, or TCP gives up first) while its process
                           still lives, so that what it sends then is refused (counted in the
                           job record's ``refused``); ``exited``, once
                           its process has exited (it noticed the dead link itself), when a new
                           worker starts in its place.
* ``peer-partition``       one worker is cut from its peers only, the scheduler still reaches
                           it; healed once the job ended (the monitor and controller decide).
* ``scheduler-partition``  every worker is cut from the scheduler at once, then healed, drawn
                           from the seed: ``short``, after half the comm timeout (Dask drops
                           no one; the job goes on), or ``dropped``, once the scheduler dropped
                           them all (each closes itself): new workers start, as a deployment
                           restarts what exits, and the job goes on from its newest checkpoint.

A test pins the heal (``AsyncRun(heal=...)``); the run reports it as ``heal``.

Every process of a run gets the chaos config with short comm timeouts (:data:`TIMEOUTS`), so
that a dead link is noticed in seconds, not Dask's 30, and a sync pull's within the hang floor.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from antdt.jobs import JobClient
from antdt.jobs.client import FINAL
from pipeline.bench.chaos_run import EPOCHS, WAIT_S, Watch
from pipeline.bench.network import NetworkCluster, namespaces_available
from pipeline.bench.processes import wait_until

NETWORK_SCENARIOS = ("partition", "peer-partition", "scheduler-partition")
HEALS = ("early", "zombie", "exited")
SCHEDULER_HEALS = ("short", "dropped")
TCP_S = 12
"""``distributed.comm.timeouts.tcp`` of a run's processes (Dask refuses less than 11 s)."""
TIMEOUTS = {"DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": f"{TCP_S}s",
            "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": f"{TCP_S}s",
            "DASK_ANTDT__SYNC__PULL_TIMEOUT": "1s"}
"""Every process's comm timeouts, and a sync pull's: below the chaos config's hang floor (2 s),
or a round with a peer cut off holds its partners' training long enough to look hung."""


def network(run: Any, workers: int) -> NetworkCluster:
    """A new namespaced cluster of ``workers`` workers for ``run`` (an
    :class:`~pipeline.bench.chaos.AsyncRun`), its logs in the run's folder."""
    why = namespaces_available()
    if why is not None:
        raise RuntimeError(f"the network scenarios need network namespaces: {why}")
    folder = run.folder / f"cluster-{run.clusters}"
    run.clusters += 1
    folder.mkdir()
    return NetworkCluster(folder, workers, env={**run.env, **TIMEOUTS}, allow_faults=True,
                          timeout_s=WAIT_S)


def _member(jobs: JobClient, address: str) -> bool:
    return address in jobs.client.scheduler_info(n_workers=-1)["workers"]


def partition(run: Any) -> dict[str, Any]:
    gate = run.gate(0.3, run.released)
    drawn = HEALS[run.rng.randrange(len(HEALS))]
    heal = run.heal = run.heal or drawn
    with network(run, 3) as net, JobClient(net.address) as jobs:
        jobs.submit(run.spec(faults={index: gate for index in range(3)}), job_id=run.job_id)
        share = run.rng.uniform(0.1, 0.25)
        if run.at_share(jobs, share)["state"] in FINAL:
            return run.end(jobs)  # it failed
        victim = run.rng.randrange(3)
        address = net.workers[victim]
        pid = jobs.client.run(os.getpid, workers=[address])[address]
        net.cut(victim)
        run.kills += 1
        if heal == "early":  # once the others trained on (their next rows the master heard
            # of), well before the monitor's hang floor or TCP could notice the cut
            trained = jobs.status(run.job_id)["rows"].get("trained", 0)
            run.at_share(jobs, (trained + 1) / (run.rows * EPOCHS))
            net.heal(victim)
        else:
            run.until(jobs, lambda: not _member(jobs, address), "the cut worker's removal")
            if heal == "zombie":
                zombie(net, victim, pid)
            else:
                run.until(jobs, lambda: net.worker_commands[victim].poll() is not None,
                          "the cut worker's exit")
                net.heal(victim)
                net.restart(victim)
        run.release(jobs)
        return run.end(jobs)


def zombie(net: NetworkCluster, victim: int, pid: int) -> None:
    """Heal worker ``victim``'s cut while its process (``pid``) lives on, the scheduler having
    removed it, the process stalled (stopped, as by a long pause of its VM) from before the heal
    until ``TCP_S`` after it: the scheduler's word that it was removed dies with the link, so
    it goes on as a zombie when it wakes, training and calling the scheduler and its peers,
    until its heartbeats are refused."""
    os.kill(pid, signal.SIGSTOP)
    try:
        net.heal(victim)
        threading.Event().wait(TCP_S)  # the stall: the fault's length, not a wait for an event
    finally:
        os.kill(pid, signal.SIGCONT)


def peer_partition(run: Any) -> dict[str, Any]:
    gate = run.gate(0.3, run.released)
    with network(run, 3) as net, JobClient(net.address) as jobs:
        jobs.submit(run.spec(faults={index: gate for index in range(3)}), job_id=run.job_id)
        if run.at_share(jobs, run.rng.uniform(0.1, 0.25))["state"] in FINAL:
            return run.end(jobs)  # it failed
        victim = run.rng.randrange(3)
        net.cut(victim, from_="peers")
        run.kills += 1
        run.release(jobs)
        try:
            return run.end(jobs)
        finally:
            net.heal(victim)


def scheduler_partition(run: Any) -> dict[str, Any]:
    gate = run.gate(0.3, run.released)
    spec = run.spec(checkpoint_every="1s", faults={index: gate for index in range(3)})
    with network(run, 3) as net, JobClient(net.address) as jobs:
        jobs.submit(spec, job_id=run.job_id)
        if run.at_share(jobs, run.rng.uniform(0.1, 0.25))["state"] in FINAL:
            return run.end(jobs)  # it failed
        drawn = SCHEDULER_HEALS[run.rng.randrange(len(SCHEDULER_HEALS))]
        run.heal = run.heal or drawn
        for index in range(3):
            net.cut(index, from_="scheduler")
        run.kills += 3
        if run.heal == "short":  # the fault's length: half the time TCP takes to give up
            threading.Event().wait(TCP_S / 2)
        else:
            wait_until(lambda: not jobs.client.scheduler_info(n_workers=-1)["workers"],
                       "the scheduler to drop every worker", WAIT_S)
        for index in range(3):
            net.heal(index)
        for index in range(3):
            if run.heal == "dropped":
                exited = net.worker_commands[index]
                wait_until(lambda: exited.poll() is not None,
                           f"worker {index} to close itself", WAIT_S)
                net.restart(index)
        run.release(jobs)
        return run.end(jobs)


NETWORK_RUNNERS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "partition": partition, "peer-partition": peer_partition,
    "scheduler-partition": scheduler_partition}
