"""A job's plan on the wire: the memory a replica needs travels, is validated, and refuses a
job whose workers cannot hold it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from antdt.errors import JobError
from antdt.jobs import JobPlan

GIB = 2**30
PLAN = JobPlan("j", [("a.parquet", 0, 100)], batch_rows=10, shard_rows=50)


def test_replica_bytes_round_trip_and_default_to_none_on_the_wire() -> None:
    sized = dataclasses.replace(PLAN, replica_bytes=3 * GIB)
    assert JobPlan.from_dict(sized.to_dict()) == sized
    older = PLAN.to_dict()
    del older["replica_bytes"]  # a client that does not size its jobs
    assert JobPlan.from_dict(older).replica_bytes is None
    assert JobPlan.from_dict(PLAN.to_dict()) == PLAN


@pytest.mark.parametrize("value", [0, -1, 1.5, "3 GiB", True])
def test_a_replica_bytes_that_is_no_positive_int_is_refused(value: Any) -> None:
    with pytest.raises(JobError, match=f"job plan replica_bytes: expected an int >= 1, "
                                       f"found {value!r}"):
        JobPlan.from_dict(PLAN.to_dict() | {"replica_bytes": value})


def test_workers_whose_memory_limit_holds_the_replica_or_that_have_none_pass() -> None:
    sized = dataclasses.replace(PLAN, replica_bytes=GIB)
    sized.check_memory({"tcp://a:1": GIB, "tcp://b:1": 0, "tcp://c:1": None})
    PLAN.check_memory({"tcp://a:1": 1})  # not sized: not checked


def test_the_refusal_names_the_smallest_limit_and_how_many_workers_are_short() -> None:
    sized = dataclasses.replace(PLAN, replica_bytes=3 * GIB)
    with pytest.raises(JobError) as refused:
        sized.check_memory({"tcp://a:1": 2 * GIB, "tcp://b:1": GIB, "tcp://c:1": 4 * GIB})
    message = str(refused.value)
    assert message.startswith("the model needs 3.00 GiB per worker in async mode")
    assert "but worker tcp://b:1's memory limit is 1.00 GiB (2 of the job's 3 workers have " \
           "less than it needs)" in message
    assert "--mode sync" in message and "model.tables: sharded" in message
    assert "\n" not in message


def test_sharded_tables_are_chosen_when_the_replica_does_not_fit_and_refused_when_they_do_not(
        ) -> None:
    tables = {"placement": "auto", "total_rows": 100, "dim": 4, "bytes": 3 * GIB}
    sized = dataclasses.replace(PLAN, replica_bytes=3 * GIB, tables=tables)
    assert sized.sharded_tables({"a": 4 * GIB}) is None  # the replica fits: replicated
    spec = sized.sharded_tables({"a": 4 * GIB, "b": 2 * GIB})
    assert spec == {"total_rows": 100, "dim": 4}  # one worker is short: sharded
    sized.check_sharded_memory({w: 2 * GIB for w in "abcd"})  # 2 x 3 GiB over 4: 1.5 GiB each
    with pytest.raises(JobError, match="need 3.00 GiB per worker"):
        sized.check_sharded_memory({"a": 2 * GIB, "b": 2 * GIB})
    assert dataclasses.replace(sized, mode="sync").sharded_tables({"a": 1}) is None
