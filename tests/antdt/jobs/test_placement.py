"""Where a job's agents run (:class:`Placement`), with a virtual clock and made-up loads: no
cluster."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection

from antdt.agent import AgentReport, SavedModel
from antdt.jobs.placement import Placement, Slot
from antdt.jobs.spec import JobPlan

WORKERS = ["tcp://a", "tcp://b", "tcp://c", "tcp://d"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Cluster:
    """The other jobs' placements and each worker's running tasks, as the scheduler has them."""

    def __init__(self) -> None:
        self.jobs: list[Collection[str]] = []
        self.tasks: dict[str, int] = {}

    def placement(self, workers: int | None = None, clock: Clock | None = None,
                  **plan: object) -> Placement:
        job = JobPlan("job", [("a.parquet", 0, 100_000)], batch_rows=100, shard_rows=1000,
                      workers=workers, **plan)
        return Placement(job, clock or Clock(), lambda: self.jobs,
                         lambda w: self.tasks.get(w, 0))


def report(outcome: str = "finished", rows: int = 10) -> AgentReport:
    return AgentReport(worker="w", outcome=outcome, rows=rows,
                       batches=1, leases=1, seconds=1.0, busy_s=0.5, loss=math.nan,
                       exchanges=0, device="cpu", cpu_s=0.25)


def test_a_job_without_a_cap_trains_on_every_worker_and_every_newcomer() -> None:
    placement = Cluster().placement()
    assert placement.initial(WORKERS[2::-1]) == WORKERS[:3]
    for worker in WORKERS[:3]:
        placement.add(worker)
    assert placement.joiners(WORKERS) == ["tcp://d"]
    assert placement.cap is None and placement.adapted is None


def test_a_capped_job_takes_the_workers_with_fewest_other_jobs_then_fewest_tasks() -> None:
    cluster = Cluster()
    cluster.jobs = [["tcp://a", "tcp://b"], ["tcp://a"]]
    cluster.tasks = {"tcp://c": 3, "tcp://d": 1}
    assert cluster.placement(workers=1).initial(WORKERS) == ["tcp://d"]
    assert cluster.placement(workers=2).initial(WORKERS) == ["tcp://c", "tcp://d"]
    assert cluster.placement(workers=3).initial(WORKERS) == ["tcp://b", "tcp://c", "tcp://d"]
    cluster.tasks = {}
    assert cluster.placement(workers=1).initial(WORKERS) == ["tcp://c"]  # then by address


def test_two_jobs_starting_together_choose_apart() -> None:
    plan = JobPlan("job", [("a.parquet", 0, 1000)], batch_rows=10, shard_rows=100, workers=2)
    jobs: list[Placement] = []

    def others(me: int) -> list[set[str]]:
        return [job.placed for i, job in enumerate(jobs) if i != me]

    jobs.extend(Placement(plan, Clock(), lambda i=i: others(i), lambda w: 0) for i in range(2))
    assert jobs[0].initial(WORKERS) == ["tcp://a", "tcp://b"]
    assert jobs[0].placed == {"tcp://a", "tcp://b"}  # before any of its agents started
    assert jobs[1].initial(WORKERS) == ["tcp://c", "tcp://d"]


def test_a_job_too_small_for_its_workers_is_fitted_and_says_why() -> None:
    placement = Cluster().placement(workers=4, min_batches_per_worker=400)
    assert placement.initial(WORKERS) == ["tcp://a", "tcp://b"]
    assert placement.cap == 2
    assert placement.adapted is not None and "training on 2" in placement.adapted


def test_a_capped_job_replaces_only_agents_that_died_skipping_retired_workers() -> None:
    cluster = Cluster()
    placement = cluster.placement(workers=2)
    for worker in placement.initial(WORKERS[:3]):
        placement.add(worker)
    assert placement.joiners(WORKERS) == []  # a newcomer: the job has its two agents
    placement.write_off(placement.slots[0])  # tcp://a was retired: it left the cluster
    cluster.tasks = {"tcp://c": 2}
    assert placement.joiners(WORKERS[1:]) == ["tcp://d"]
    joiner = placement.add("tcp://d", join=True)
    assert joiner.index == 2 and joiner.join and joiner.label == "worker2"
    assert placement.joiners(WORKERS) == []  # tcp://a came back: it had its agent


def test_a_finished_agent_still_counts_a_declined_one_does_not() -> None:
    placement = Cluster().placement(workers=2)
    first, second = (placement.add(w) for w in placement.initial(WORKERS))
    placement.returned(first, report("finished"))
    assert placement.joiners(WORKERS) == []
    placement.returned(second, report("declined", rows=0))
    assert placement.joiners(WORKERS) == ["tcp://c"]


def test_slots_keep_their_times_on_the_training_clock_and_the_reports_counts() -> None:
    clock = Clock()
    placement = Cluster().placement(clock=clock)
    clock.now = 1.5
    slot = placement.add("tcp://a")
    slot.rows, slot.rate = 3, 40.0  # its last progress event
    clock.now = 9.0
    placement.returned(slot, report(rows=10))
    assert (slot.started, slot.ended, slot.rows, slot.busy_s, slot.cpu_s) == (
        1.5, 9.0, 10, 0.5, 0.25)
    assert not slot.live and slot.finished
    assert slot.as_dict() == {
        "worker": "tcp://a", "index": 0, "label": "worker0", "join": False, "started": 1.5,
        "ended": 9.0, "rows": 10, "busy_s": 0.5, "cpu_s": 0.25, "samples_per_s": 40.0,
        "dead": False, "outcome": "finished", "batches": 1, "loss": None, "exchanges": 0,
        "joined_from": None, "sync_wait_s": 0.0}


def test_every_agent_lost_and_a_restart_chooses_among_all_workers() -> None:
    clock = Clock()
    placement = Cluster().placement(workers=2, clock=clock)
    assert not placement.every_lost()  # no agent yet
    for worker in placement.initial(WORKERS[:2]):
        placement.add(worker)
    clock.now = 4.0
    placement.write_off(placement.slots[0])
    assert not placement.every_lost()
    placement.write_off(placement.slots[1])
    assert placement.every_lost() and placement.live == []
    assert [s.as_dict()["outcome"] for s in placement.slots] == ["dead", "dead"]
    assert placement.slots[1].ended == 4.0
    assert placement.restart(["tcp://b", "tcp://a", "tcp://c"]) == ["tcp://a", "tcp://b"]


def test_a_slot_is_plain_data() -> None:
    slot = Slot("tcp://a", 0, join=False, started=0.0)
    assert slot.live and not slot.finished and slot.as_dict()["outcome"] == "running"


def test_the_final_model_is_the_current_models_and_on_a_live_worker_or_in_parts() -> None:
    """A synchronous group whose rank 1 died after the final gather: rank 0's report holds the
    model, which counts while its worker lives. After a restart the old forming's finished
    agents hold nothing the job can use (their model predates the restart): only the new
    forming's rank 0 does, or the parts its ranks wrote."""
    placement = Cluster().placement()
    rank0, rank1 = (placement.add(w) for w in placement.initial(WORKERS[:2]))
    placement.returned(rank0, dataclasses.replace(report(), holds_model=True))
    placement.write_off(rank1)
    assert placement.final_model(alive=WORKERS) is rank0
    assert placement.final_model(alive=WORKERS[1:]) is None  # its worker died since
    again = [placement.add(w) for w in placement.restart(WORKERS[2:])]
    assert placement.current == again and rank0 not in placement.current
    assert placement.final_model(alive=WORKERS) is None
    placement.returned(again[1], report())
    placement.returned(again[0], dataclasses.replace(
        report(), saved_model=SavedModel("/c/j/model", {"part-0": {"bytes": 1}})))
    assert placement.final_model(alive=[]) is again[0]
