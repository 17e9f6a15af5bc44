"""Absurd sizes are refused where a job is built and again where it is submitted, in one line
each, before any worker does anything for it (issue 60, item 4)."""

from __future__ import annotations

from typing import Any

import pytest

from antdt.errors import JobError, LedgerError
from antdt.jobs import JobClient
from antdt.jobs.spec import JobPlan
from antdt.sharding import ShardLedger
from antdt.sharding.dealing import MAX_EPOCHS, MAX_SHARDS
from fakes import job_service, spec

GROUPS = [("a.parquet", 0, 100), ("b.parquet", 0, 60)]
GiB = 2**30


def plan(**fields: Any) -> JobPlan:
    return JobPlan(**{"name": "j", "row_groups": GROUPS, "batch_rows": 8, "shard_rows": 20,
                      **fields})


@pytest.mark.parametrize(("fields", "message"), [
    ({"epochs": MAX_EPOCHS + 1}, "job plan epochs: expected 1 to 1,000 epochs, found 1,001"),
    ({"row_groups": [("a.parquet", 0, 10**9)], "shard_rows": 1},
     "job plan shard_rows: shards of 1 row cut the 1,000,000,000 rows into 1,000,000,000 "
     "shards, more than the 2,000,000 a job may have; use shard_rows >= 500"),
    ({"batch_rows": 161}, "job plan batch_rows: a batch of 161 rows is larger than the data "
                          "(160 rows an epoch)"),
    ({"batch_rows": 2**31}, "job plan batch_rows: expected 1 to 2,147,483,647 rows, found "
                            "2,147,483,648"),
])
def test_a_plan_with_absurd_sizes_is_refused_where_it_is_built(fields: dict[str, Any],
                                                               message: str) -> None:
    with pytest.raises(JobError) as built:
        plan(**fields)
    assert str(built.value) == message
    wire = {**plan().to_dict(), **fields}
    wire["row_groups"] = [list(group) for group in wire["row_groups"]]
    with pytest.raises(JobError) as received:  # and where the master receives it
        JobPlan.from_dict(wire)
    assert "\n" not in str(received.value)
    assert str(received.value).split(":")[0] == message.split(":")[0]


def test_the_bounds_let_real_sizes_through() -> None:
    shards = plan(row_groups=[(f"{i}.parquet", 0, 1000) for i in range(MAX_SHARDS // 4)],
                  batch_rows=4096, shard_rows=1000, epochs=MAX_EPOCHS)
    assert len(shards.row_groups) == MAX_SHARDS // 4
    plan(batch_rows=160).check_cluster({"a": 1, "b": None})  # the batch is the whole data


def test_a_cluster_that_could_never_hold_the_job_refuses_it() -> None:
    limits = {"tcp://a:1": 2 * GiB, "tcp://b:1": 2 * GiB}
    with pytest.raises(JobError, match=r"^the sharded tables need 10.00 GiB with a backup of "
                                       r"each bucket, more than the 2 workers' memory together "
                                       r"\(4.00 GiB\)"):
        plan(tables={"placement": "sharded", "bytes": 5 * GiB}).check_cluster(limits)
    plan(tables={"placement": "sharded", "bytes": GiB}).check_cluster(limits)
    with pytest.raises(JobError, match=r"^the model needs 3.00 GiB per worker"):
        plan(replica_bytes=3 * GiB).check_cluster(limits)
    plan(replica_bytes=3 * GiB).check_cluster({**limits, "tcp://c:1": 4 * GiB})
    with pytest.raises(JobError, match=r"^row group 0 of a.parquet holds 100 rows, 9.54 MiB in "
                                       r"the reader \(100,000 bytes a row\), more than a "
                                       r"worker's budget for it \(4.00 MiB"):
        plan(row_bytes=100_000).check_cluster({"a": 16 * 2**20})
    plan(row_bytes=100_000).check_cluster({"a": GiB})


def test_the_ledger_refuses_them_too_and_quickly() -> None:
    with pytest.raises(LedgerError, match="epochs must be in"):
        ShardLedger(GROUPS, shard_rows=20, batch_rows=8, clock=lambda: 0.0,
                    epochs=MAX_EPOCHS + 1)
    with pytest.raises(LedgerError, match="more than the 2,000,000 a job may have"):
        ShardLedger([("a.parquet", 0, MAX_SHARDS + 1)], shard_rows=1, batch_rows=1,
                    clock=lambda: 0.0)  # counted before any per-shard array is made


@pytest.fixture(scope="module")
def jobs() -> Any:
    with job_service() as job_client:
        yield job_client


@pytest.mark.parametrize(("fields", "message"), [
    ({"epochs": 10**6}, "job plan epochs: expected an int >= 1 and <= 1,000, found 1000000"),
    ({"shard_rows": 1, "row_groups": [["a.parquet", 0, 2**31 - 1]]},
     "more than the 2,000,000 a job may have"),
    ({"batch_rows": 10**4}, "larger than the data"),
    ({"tables": {"placement": "sharded", "bytes": 2**50}}, "the sharded tables need"),
    ({"replica_bytes": 2**50}, "the model needs 1.00 PiB per worker"),
    ({"row_bytes": 2**40}, "more than a worker's budget for it"),
])
def test_a_submit_with_absurd_sizes_is_refused_before_any_worker_work(
        jobs: JobClient, fields: dict[str, Any], message: str) -> None:
    before = {job["job_id"] for job in jobs.status()}
    job = spec()
    reply = jobs.client.sync(jobs.client.scheduler.antdt_job_submit,
                             plan={**job.plan.to_dict(), **fields}, code=job.code.to_dict())
    assert reply["status"] == "error" and message in reply["message"], reply
    assert "\n" not in reply["message"]
    assert {job["job_id"] for job in jobs.status()} == before  # no job, no agent, no task
