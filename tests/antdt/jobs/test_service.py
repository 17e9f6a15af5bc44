"""AntDT's master: jobs submitted to the JobService on a LocalCluster whose workers run in this
process, with the trivial model of ``fakes`` and test-only hooks that record every call."""

from __future__ import annotations

import gc
import inspect
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import dask.config
import pytest
import torch
from dask.utils import format_bytes
from distributed import Client, LocalCluster

from antdt.errors import JobError
from antdt.jobs import JobClient
from fakes import (CALLS, FROZEN_AT_BUILD, FROZEN_AT_FINISH, GATES, TOTAL, RecordingHooks, calls,
                   job_service, ran_on, spec, wait_for_gate)
from waits import bounded


@pytest.fixture(scope="module")
def jobs() -> Iterator[JobClient]:
    """Two single-thread workers in this process and the job service."""
    with job_service() as job_client:
        yield job_client


def test_a_job_trains_every_row_and_reports_through_its_hooks(jobs: JobClient) -> None:
    submitted = jobs.submit(spec(epochs=2))
    assert not submitted["attached"] and submitted["job"]["state"] == "starting"
    record = bounded.call(jobs.follow, submitted["job"]["job_id"])

    assert record["state"] == "finished" and record["error"] is None
    assert record["ended_at"] >= record["started_at"] >= record["submitted_at"]
    rows = record["rows"]
    assert (rows["expected"], rows["done"], rows["trained"], rows["lost"],
            rows["retrained"]) == (2 * TOTAL, 2 * TOTAL, 2 * TOTAL, 0, 0)
    assert rows["done_by_epoch"] == [TOTAL, TOTAL]
    assert record["summary"] == {"rows_trained": 2 * TOTAL, "with_model": True}
    made = calls(record)
    assert made[0] == ("start", record["job_id"], 2)
    assert [c[0] for c in made[1:]].count("finish") == 1 and made[-1][0] == "finish"
    steps = [step for c in made if c[0] == "metrics" for step, _ in c[1]]
    assert steps == list(range(len(steps))) and steps  # every step once, in order
    _, table, report = made[-1]
    assert torch.equal(table, torch.full((TOTAL, 1), 2.0))  # the consensus model
    assert sum(a["rows"] for a in report["agents"]) == 2 * TOTAL
    assert {a["outcome"] for a in report["agents"]} == {"finished"}
    assert all(a["busy_s"] >= a["cpu_s"] > 0 for a in report["agents"])
    assert sum(s["rows"] for s in report["spans"]) == 2 * TOTAL
    assert set(report["first_lease"]) == {a["worker"] for a in report["agents"]}
    messages = [r["message"] for r in jobs.logs(record["job_id"])]
    assert messages[0].startswith("registered: 320 rows") and messages[-1] == "finished"


def test_the_metrics_go_to_the_worker_that_opened_the_tracking_run(jobs: JobClient) -> None:
    """Even when its thread is taken: Dask would send them to the idle worker."""
    reads, busy = (f"gate-{uuid.uuid4().hex[:6]}" for _ in "12")
    GATES[reads], GATES[busy] = threading.Event(), threading.Event()
    job_id = jobs.submit(spec(epochs=3, gate=reads))["job"]["job_id"]
    bounded.until(lambda: len(jobs.status(job_id)["workers"]) == 2, "both agents started")
    [opened] = ran_on(jobs.status(job_id))["start"]
    blocker = jobs.client.submit(wait_for_gate, busy, workers=[opened], pure=False)
    bounded.until(lambda: blocker.key in jobs.client.processing([opened])[opened],
                  "the blocker runs")
    GATES[reads].set()
    bounded.until(lambda: jobs.status(job_id)["rows"]["done"] == 3 * TOTAL, "every row done")
    GATES[busy].set()
    record = bounded.call(jobs.follow, job_id)

    assert record["state"] == "finished" and blocker.result() is True
    assert ran_on(record)["metrics"] == {opened}
    assert sum(c[0] == "metrics" for c in calls(record)) >= 2


def test_the_heaps_are_frozen_from_before_the_agents_start_until_the_job_ends(
        jobs: JobClient) -> None:
    """A full collection over a worker's imports as its agent task arrived would hold up the
    agent (and the job's start) for half a second, one over the scheduler's every lease and
    sync group; the workers and the scheduler share this process, so the test sees their heap:
    frozen as the models are built, still frozen once the agents ended (the master's job is not
    over), thawed after."""
    FROZEN_AT_BUILD.clear()
    FROZEN_AT_FINISH.clear()
    record = bounded.call(jobs.follow, jobs.submit(spec())["job"]["job_id"])

    assert record["state"] == "finished"
    assert len(FROZEN_AT_BUILD) == 2 and min(FROZEN_AT_BUILD) > 100_000
    assert len(FROZEN_AT_FINISH) == 1 and FROZEN_AT_FINISH[0] > 100_000
    assert gc.get_freeze_count() == 0  # the job's end unfroze them


def test_a_second_submit_with_the_same_id_attaches(jobs: JobClient) -> None:
    job_id = f"attach-{uuid.uuid4().hex[:6]}"
    first = jobs.submit(spec(), job_id=job_id)
    again = jobs.submit(spec(), job_id=job_id)
    assert (first["attached"], again["attached"]) == (False, True)
    assert again["job"]["job_id"] == job_id
    record = bounded.call(jobs.follow, job_id)
    assert record["state"] == "finished"
    assert [c[0] for c in calls(record)].count("start") == 1  # one job, one run


def test_cancel_stops_the_agents_and_ends_the_run_as_killed(jobs: JobClient) -> None:
    gate = f"gate-{uuid.uuid4().hex[:6]}"
    GATES[gate] = threading.Event()
    job_id = jobs.submit(spec(epochs=3, gate=gate))["job"]["job_id"]
    bounded.until(lambda: len(jobs.status(job_id)["workers"]) == 2, "both agents started")
    reply = jobs.cancel(job_id, "the test cancels it")
    GATES[gate].set()
    record = bounded.call(jobs.follow, job_id)

    assert reply["cancelled"] and reply["job"]["state"] == "cancelling"
    assert record["state"] == "cancelled" and record["summary"] is None
    assert calls(record)[-1] == ("abort", "KILLED", "the test cancels it")
    assert record["rows"]["lost"] == 3 * TOTAL - record["rows"]["done"] > 0
    again = jobs.cancel(job_id)
    assert not again["cancelled"] and again["job"]["state"] == "cancelled"


def test_two_jobs_run_at_once_each_with_its_own_ledger(jobs: JobClient) -> None:
    first = jobs.submit(spec(epochs=2))["job"]["job_id"]
    second = jobs.submit(spec(epochs=1))["job"]["job_id"]
    records = [bounded.call(jobs.follow, job) for job in (first, second)]

    assert [r["state"] for r in records] == ["finished", "finished"]
    assert [r["rows"]["done"] for r in records] == [2 * TOTAL, TOTAL]
    assert [r["rows"]["retrained"] + r["rows"]["lost"] for r in records] == [0, 0]
    listed = {r["job_id"]: r["state"] for r in jobs.status()}
    assert listed[first] == listed[second] == "finished"


def test_a_failing_hook_fails_the_job_with_its_error(jobs: JobClient) -> None:
    job_id = jobs.submit(spec(hooks=RecordingHooks(fail="finish")))["job"]["job_id"]
    record = bounded.call(jobs.follow, job_id)
    assert record["state"] == "failed"
    assert "the test's hooks fail in finish" in record["error"]
    assert calls(record)[-1][:2] == ("abort", "FAILED")

    job_id = jobs.submit(spec(hooks=RecordingHooks(fail="start")))["job"]["job_id"]
    record = bounded.call(jobs.follow, job_id)
    assert record["state"] == "failed" and record["workers"] == []  # no agent started
    assert "the test's hooks fail in start" in record["error"]


def test_faults_naming_a_missing_worker_fail_the_job(jobs: JobClient) -> None:
    job_id = jobs.submit(spec(faults={5: {"slowdown": 2.0}}))["job"]["job_id"]
    record = bounded.call(jobs.follow, job_id)
    assert record["state"] == "failed"
    assert "faults name worker(s) [5], but the job trains on only 2 worker(s)" in record["error"]

    job_id = jobs.submit(spec(workers=1, faults={1: {"slowdown": 2.0}}))["job"]["job_id"]
    record = bounded.call(jobs.follow, job_id)
    assert "faults name worker(s) [1], but the job trains on only 1 worker(s)" in record["error"]


def test_a_replica_bigger_than_a_worker_s_memory_limit_is_refused_before_anything_starts(
        jobs: JobClient) -> None:
    limits = jobs.client.run(lambda dask_worker: dask_worker.memory_manager.memory_limit)
    worker, limit = min(limits.items(), key=lambda item: (item[1], item[0]))
    before = {job["job_id"] for job in jobs.status()}
    with pytest.raises(JobError) as refused:  # where it is submitted: no job, no worker work
        jobs.submit(spec(replica_bytes=2 * limit))
    assert {job["job_id"] for job in jobs.status()} == before
    assert str(refused.value) == (
        f"the model needs {format_bytes(2 * limit)} per worker in async mode (every worker "
        f"holds a full replica), but worker {worker}'s memory limit is {format_bytes(limit)} "
        f"(2 of the job's 2 workers have less than it needs); shard its tables over the workers "
        f"(model.tables: sharded or auto), train it with --mode sync, or give the workers more "
        f"memory")

    fits = bounded.call(jobs.follow, jobs.submit(spec(replica_bytes=limit))["job"]["job_id"])
    assert fits["state"] == "finished" and fits["rows"]["done"] == TOTAL


def test_jobs_that_ask_for_fewer_workers_train_side_by_side(jobs: JobClient) -> None:
    gate = f"gate-{uuid.uuid4().hex[:6]}"
    GATES[gate] = threading.Event()
    first, second = (jobs.submit(spec(gate=gate, workers=1))["job"]["job_id"] for _ in "12")
    bounded.until(lambda: all(jobs.status(job)["workers"] for job in (first, second)),
                  "both jobs' agents started")
    placed = [{w["worker"] for w in jobs.status(job)["workers"]} for job in (first, second)]
    GATES[gate].set()
    records = [bounded.call(jobs.follow, job) for job in (first, second)]

    assert len(placed[0]) == len(placed[1]) == 1 and placed[0] != placed[1]
    assert [r["state"] for r in records] == ["finished", "finished"]
    assert [r["rows"]["done"] for r in records] == [TOTAL, TOTAL]
    assert [calls(r)[0][2] for r in records] == [1, 1]  # each run records one worker
    assert [len(r["agents"]) for r in records] == [1, 1]  # no other worker joined


@pytest.mark.parametrize("call, message", [
    (dict(handler="antdt_job_submit", plan={"name": "x"}, code={}), "row_groups"),
    (dict(handler="antdt_job_submit", plan=spec().plan.to_dict() | {"epochs": 0},
          code=spec().code.to_dict()), "epochs: expected an int >= 1 and <= 1,000, found 0"),
    (dict(handler="antdt_job_submit", plan=spec().plan.to_dict(),
          code={"trainer": b"not a pickle", "reader": b"", "hooks": b""}), "job code"),
    (dict(handler="antdt_job_submit", plan=spec().plan.to_dict() | {"sharding": "magic"},
          code=spec().code.to_dict()), "sharding: expected one of"),
    (dict(handler="antdt_job_submit", plan=spec().plan.to_dict() | {"replica_bytes": "1 GiB"},
          code=spec().code.to_dict()), "replica_bytes: expected an int >= 1, found '1 GiB'"),
    (dict(handler="antdt_job_status", job_id="no-such-job"), "unknown job 'no-such-job'"),
    (dict(handler="antdt_job_status", job_id="../etc"), "job_id must be"),
    (dict(handler="antdt_job_wait", job_id="no-such-job", version=0), "unknown job"),
    (dict(handler="antdt_job_logs", job_id=7), "job_id must be"),
    (dict(handler="antdt_job_cancel", job_id="no-such-job"), "unknown job"),
])
def test_malformed_calls_are_refused_by_name(jobs: JobClient, call: dict[str, Any],
                                             message: str) -> None:
    arguments = dict(call)
    handler = getattr(jobs.client.scheduler, arguments.pop("handler"))
    reply = jobs.client.sync(handler, **arguments)  # an error reply, never an exception
    assert reply["status"] == "error" and message in reply["message"], reply


def valid_calls(jobs: JobClient, job_id: str, folder: str) -> dict[str, dict[str, Any]]:
    """Every scheduler handler of the antdt plugins with arguments of the right types that
    name the running job ``job_id`` (several of them, called as they are, would disturb it)."""
    worker = jobs.status(job_id)["workers"][0]["worker"]
    job = {"job": job_id}
    lease = {**job, "lease_id": 10**6}
    return {
        "antdt_job_submit": {"plan": spec().plan.to_dict(), "code": spec().code.to_dict(),
                             "job_id": None},
        "antdt_job_status": {"job_id": job_id},
        "antdt_job_wait": {"job_id": job_id, "version": 0, "timeout_s": 0.01},
        "antdt_job_logs": {"job_id": job_id, "since": 0},
        "antdt_job_cancel": {"job_id": job_id, "reason": "a malformed call"},
        "antdt_sync_start": {**job, "workers": [worker], "group_size": 2, "max_wait_s": 0.05,
                             "max_progress_gap": 1},
        "antdt_sync_group": {**job, "worker": worker, "progress": 0, "final": False,
                             "members_version": None},
        "antdt_sync_members": job,
        "antdt_sync_join": {**job, "worker": worker},
        "antdt_sync_started": {**job, "worker": worker},
        "antdt_sync_leave": {**job, "worker": worker},
        "antdt_sync_complete": {**job, "worker": worker, "adopted_from": None},
        "antdt_sync_stop": job,
        "antdt_sync_rank": {**job, "worker": worker},
        "antdt_tables_map": job,
        "antdt_tables_join": {**job, "worker": worker},
        "antdt_tables_leave": {**job, "worker": worker},
        "antdt_tables_backup_lost": {**job, "worker": worker, "buckets": [0]},
        "antdt_tables_drain": {**job, "worker": worker},
        "antdt_tables_latency": {**job, "worker": worker, "pulls_ms": {worker: 1.0}},
        "antdt_tables_held": {**job, "worker": worker, "timeout_s": 0.01},
        "antdt_register_job": {"job": f"{job_id}-new", "row_groups": [["a.parquet", 0, 10]],
                               "shard_rows": 4, "batch_rows": 2, "epochs": 1, "seed": 0,
                               "quarantine": None, "max_claim_rows": None, "static": None},
        "antdt_lease": {**job, "worker": worker, "claim_rows": None, "commits": None,
                        "wait_s": 0, "synced_rows": None},
        "antdt_commit": {**job, "commits": [], "worker": worker, "synced_rows": None},
        "antdt_ledger_copy": job,
        "antdt_release": {**lease, "token": "guess"},
        "antdt_quarantine": {**lease, "token": "guess", "stop": 1, "reason": "bad"},
        "antdt_revoke": lease,
        "antdt_split": {**lease, "parts": 2},
        "antdt_job_state": {**job, "leases": False},
        "antdt_checkpoint": {**job, "path": f"{folder}/ledger.json"},
        "antdt_restore": {**job, "path": f"{folder}/ledger.json"},
        "antdt_stop_job": {**job, "reason": "a malformed call"},
        "antdt_forget_job": job,
        "antdt_controller_actions": {**job, "since": 0},
        "antdt_controller_enable": {**job, "enabled": True},
        "antdt_controller_tick": job,
        "antdt_worker_health": job,
    }


def required_arguments(dask_scheduler: Any) -> dict[str, list[str]]:
    """The required parameters of each antdt handler on the scheduler (not ``comm``, which
    Dask passes a handler that asks for it)."""
    return {name: [p.name for p in inspect.signature(handler).parameters.values()
                   if p.default is inspect.Parameter.empty and p.name != "comm"]
            for name, handler in dask_scheduler.handlers.items() if name.startswith("antdt_")}


WRONG = ({"nested": [1, {"x": None}]}, float("nan"), b"\xff\x00")
"""Values no handler parameter accepts."""
ANY_JOB = ("antdt_job_submit", "antdt_register_job", "antdt_sync_start",
           "antdt_controller_enable", "antdt_sync_leave", "antdt_sync_stop")
"""The handlers that accept a job they do not know: the first three take a new job's name, the
controller switch may come before the job registers, and an agent's teardown calls may come
after its job's sync state is gone."""


def test_every_handler_refuses_malformed_calls_while_a_job_runs(jobs: JobClient,
                                                                tmp_path: Any) -> None:
    gate = f"gate-{uuid.uuid4().hex[:6]}"
    GATES[gate] = threading.Event()
    job_id = jobs.submit(spec(epochs=2, gate=gate))["job"]["job_id"]
    bounded.until(lambda: len(jobs.status(job_id)["workers"]) == 2, "both agents started")
    calls = valid_calls(jobs, job_id, str(tmp_path))
    scheduler = jobs.client.scheduler
    required = jobs.client.run_on_scheduler(required_arguments)
    assert set(required) == set(calls)  # every handler is driven

    def refused(handler: str, arguments: dict[str, Any], *words: str) -> None:
        reply = jobs.client.sync(getattr(scheduler, handler), **arguments)
        assert reply["status"] == "error", (handler, arguments, reply)
        assert all(word in reply["message"] for word in words), (handler, arguments, reply)

    for handler, arguments in calls.items():
        refused(handler, {**arguments, "bogus": 1}, "unexpected keyword argument 'bogus'")
        for name in arguments:
            for value in WRONG:
                refused(handler, {**arguments, name: value}, name)
            if name in ("job", "job_id") and handler not in ANY_JOB:
                refused(handler, {**arguments, name: "no-such-job"}, "no-such-job")
        for name in required[handler]:
            refused(handler, {n: v for n, v in arguments.items() if n != name},
                    f"missing a required argument: '{name}'")
    restored = tmp_path / f"{job_id}-restored"
    refused("antdt_restore", {"job": restored.name, "path": str(restored / "none.json")},
            "no checkpoint folder")  # nothing names a folder for this job
    with dask.config.set({"antdt.sharding.checkpoint-root": str(tmp_path)}):
        refused("antdt_restore", {"job": restored.name, "path": str(restored / "none.json")},
                "does not exist")
        refused("antdt_restore", {"job": restored.name, "path": "/etc/hostname"},
                "outside the job's checkpoint folder")
        refused("antdt_restore", {"job": restored.name, "path": f"{restored}/../x/y"},
                "outside the job's checkpoint folder")
        restored.mkdir()
        (restored / "a-file").write_text("SECRET: not a ledger checkpoint")
        (tmp_path / job_id).write_text("a file where the job's folder would be")
        refused("antdt_checkpoint", {"job": job_id, "path": str(tmp_path / job_id / "x")},
                f"{job_id}/x")  # the job's own folder, but it cannot be written
        refused("antdt_checkpoint", {"job": job_id, "path": str(restored / "a-file" / "x")},
                "outside the job's checkpoint folder")
        reply = jobs.client.sync(scheduler.antdt_restore, job=restored.name,
                                 path=str(restored / "a-file"))
        assert reply["status"] == "error" and "a-file" in reply["message"], reply
        assert "SECRET" not in reply["message"]  # no bytes of the file in the error
    # a commit for a lease this caller does not hold (it cannot know the holder's token)
    live = jobs.client.sync(scheduler.antdt_job_state, job=job_id, leases=True)["live"]
    commit = jobs.client.sync(scheduler.antdt_commit, job=job_id, commits=[
        {"lease_id": lease["lease_id"], "token": "guess", "offset": lease["start"] + 1,
         "synced_offset": lease["start"]} for lease in live])
    assert live and [r["kind"] for r in commit["replies"]] == ["error"] * len(live)
    assert all("token" in r["message"] for r in commit["replies"]), commit
    GATES[gate].set()
    record = bounded.call(jobs.follow, job_id)

    assert record["state"] == "finished", record["error"]
    rows = record["rows"]
    assert (rows["done"], rows["trained"], rows["lost"], rows["retrained"]) == (
        2 * TOTAL, 2 * TOTAL, 0, 0)
    assert jobs.status()  # the job service still answers


def test_the_worker_finishing_a_job_dies_and_another_one_finishes_it() -> None:
    gate = f"gate-{uuid.uuid4().hex[:6]}"
    GATES[gate] = threading.Event()
    settings = {"antdt.jobs.tick": "100ms", "antdt.agent.report-interval": "50ms",
                "antdt.sync.max-wait": "50ms"}
    with dask.config.set(settings), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                         dashboard_address=":0") as cluster, Client(cluster) as client, \
            JobClient(client) as jobs:
        cluster.wait_for_workers(2)
        job_id = jobs.submit(spec(epochs=2, hooks=RecordingHooks(hold=gate)))["job"]["job_id"]
        run = bounded.until(lambda: (r := jobs.status(job_id)["run"]) and r, "the run opened")
        held = bounded.until(lambda: next((c[1] for c in CALLS[run["run_id"]]
                                           if c[0] == "held"), None), "finishing")
        worker = next(w for w in cluster.workers.values() if w.address == held)
        client.loop.add_callback(worker.close)  # its finish task is still running
        bounded.until(lambda: held not in client.scheduler_info()["workers"], "the worker gone")
        GATES[gate].set()
        record = bounded.call(jobs.follow, job_id)
        messages = [r["message"] for r in jobs.logs(job_id)]

    assert record["state"] == "finished", record["error"]
    assert record["rows"]["done"] == 2 * TOTAL and record["rows"]["lost"] == 0
    finished = [c for c in calls(record) if c[0] == "finish"]
    assert len(finished) == 1 and record["summary"]["with_model"]
    assert f"the worker finishing the job ({held}) died; trying another" in messages


def test_the_metrics_go_to_another_worker_once_the_runs_worker_left() -> None:
    gate = f"gate-{uuid.uuid4().hex[:6]}"
    GATES[gate] = threading.Event()
    settings = {"antdt.jobs.tick": "100ms", "antdt.jobs.metrics-interval": "100ms",
                "antdt.agent.report-interval": "50ms", "antdt.sync.max-wait": "50ms"}
    with dask.config.set(settings), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                         dashboard_address=":0") as cluster, Client(cluster) as client, \
            JobClient(client) as jobs:
        cluster.wait_for_workers(2)
        job_id = jobs.submit(spec(epochs=2, gate=gate))["job"]["job_id"]
        bounded.until(lambda: len(jobs.status(job_id)["workers"]) == 2, "both agents started")
        [opened] = ran_on(jobs.status(job_id))["start"]
        worker = next(w for w in cluster.workers.values() if w.address == opened)
        client.loop.add_callback(worker.close)
        bounded.until(lambda: opened not in client.scheduler_info()["workers"], "the worker gone")
        GATES[gate].set()
        record = bounded.call(jobs.follow, job_id)

    assert record["state"] == "finished", record["error"]
    assert ran_on(record)["metrics"] - {opened}
    steps = [step for c in calls(record) if c[0] == "metrics" for step, _ in c[1]]
    assert steps and set(steps) == set(range(max(steps) + 1))  # none lost on the way


def test_a_reading_client_registers_nothing_and_finds_no_job_before_the_first() -> None:
    """``register=False`` (the commands that only read or cancel): on a cluster that has never
    run an antdt job it lists none and knows none; once a registering client connected, it
    reaches the job service like any other."""
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        reading = JobClient(client, register=False)
        assert reading.status() == []
        for call in (lambda: reading.status("daily"), lambda: reading.logs("daily"),
                     lambda: reading.cancel("daily")):
            with pytest.raises(JobError, match="unknown job 'daily': no antdt job has run"):
                call()
        assert "antdt_job_status" not in client.run_on_scheduler(
            lambda dask_scheduler: list(dask_scheduler.handlers))
        JobClient(client)
        assert JobClient(client, register=False).status() == []
        with pytest.raises(JobError, match="unknown job 'daily'; jobs here"):
            reading.status("daily")  # it asks again: the service is there now


def test_finished_jobs_stay_listed_up_to_the_history_length(jobs: JobClient) -> None:
    with dask.config.set({"antdt.jobs.history": 2}):  # the in-process scheduler reads it
        ids = []
        for _ in range(3):
            ids.append(jobs.submit(spec())["job"]["job_id"])
            assert bounded.call(jobs.follow, ids[-1])["state"] == "finished"
        listed = {record["job_id"] for record in jobs.status()}

    assert ids[0] not in listed and set(ids[1:]) <= listed  # the oldest finished one went
    with pytest.raises(JobError, match=f"unknown job '{ids[0]}'"):
        jobs.status(ids[0])
