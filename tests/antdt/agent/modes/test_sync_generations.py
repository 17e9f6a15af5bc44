"""A synchronous group's generations as a partition needs them: a rank of a forming the master
replaced (cut off meanwhile, back as a zombie) is refused by the rendezvous and counted, and its
error says so; a rank of the new forming on the same worker waits for the old one to let go of
the process group; and a rank's gloo listens on the interface of its worker's own address."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch
from distributed import Scheduler, Worker
from distributed.utils_test import gen_cluster

from antdt.agent.contract import AgentSpec
from antdt.agent.modes.sync_master import Rendezvous, SyncMaster
from antdt.agent.modes.synchronous import (GLOO_INTERFACE, PROCESS_GROUP, GroupBroken,
                                           SyncMode, gloo_on, interface_of)


def serving(s: Scheduler) -> SyncMaster:
    """A job master over a rendezvous whose handler the scheduler ``s`` serves."""
    rendezvous = Rendezvous()
    s.handlers["antdt_sync_rank"] = rendezvous.rank
    return SyncMaster(rendezvous)


@gen_cluster(nthreads=[("127.0.0.1", 1)] * 2, timeout=120)
async def test_a_rank_of_a_replaced_forming_is_refused_and_counted(
        s: Scheduler, a: Worker, b: Worker) -> None:
    master = serving(s)
    master.start("j", [a.address, b.address])
    first = await a.scheduler.antdt_sync_rank(job="j", worker=a.address)
    assert first["status"] == "OK" and first["generation"] == 1
    same = await a.scheduler.antdt_sync_rank(job="j", worker=a.address, generation=1)
    assert same["status"] == "OK" and same["prefix"] == first["prefix"]
    assert master.stale_refused("j") == 0

    master.restart("j", [b.address])  # formed again without a: a was cut off
    stale = await a.scheduler.antdt_sync_rank(job="j", worker=a.address, generation=1)
    assert stale["status"] == "error" and stale["message"].startswith("stale:")
    assert "generation 1" in stale["message"] and "formed again" in stale["message"]
    assert master.stale_refused("j") == 1
    wrong = await b.scheduler.antdt_sync_rank(job="j", worker=b.address, generation=0)
    assert wrong["status"] == "error" and "generation must be an int" in wrong["message"]
    assert master.stale_refused("j") == 1  # a malformed call is not a stale one
    current = await b.scheduler.antdt_sync_rank(job="j", worker=b.address, generation=2)
    assert current["status"] == "OK" and current["rank"] == 0

    master.rendezvous.forget("j")  # the job ended; a zombie may still come back after it
    over = await b.scheduler.antdt_sync_rank(job="j", worker=b.address, generation=2)
    assert over["status"] == "error" and "is over" in over["message"]
    assert master.stale_refused("j") == 2

    master.start("j", [a.address, b.address])  # started again under its id (resumed)
    again = await b.scheduler.antdt_sync_rank(job="j", worker=b.address, generation=2)
    assert again["status"] == "error" and "generation 3" in again["message"]  # never reused
    assert master.stale_refused("j") == 3


@gen_cluster(nthreads=[("127.0.0.1", 1)], timeout=120)
async def test_a_rank_whose_group_broke_after_it_formed_again_says_it_is_stale(
        s: Scheduler, a: Worker) -> None:
    """Asked through the worker's own comm, from a thread as the training thread asks."""
    master = serving(s)
    master.start("j", [a.address])
    mode = SyncMode(AgentSpec(job="j", batch_rows=8, mode="sync"), None,  # type: ignore[arg-type]
                    torch.device("cpu"), a)
    mode.generation = 1

    def broken() -> None:
        raise RuntimeError("gloo: timed out")

    with pytest.raises(GroupBroken) as current:
        await asyncio.to_thread(mode._collective, broken, "the step")
    assert "stale" not in str(current.value)
    master.restart("j", [a.address])
    with pytest.raises(GroupBroken, match="the step failed .*; stale: worker .* generation 1"):
        await asyncio.to_thread(mode._collective, broken, "the step")
    assert master.stale_refused("j") == 1


def test_a_rank_waits_for_an_older_forming_of_its_job_to_let_go_of_the_process_group() -> None:
    """A worker the master left out of one forming (its rank stuck, cut off) and took into a
    later one: the new rank waits for the old rank's forming or collective to time out, rather
    than failing the job ("already takes part in a process group")."""
    assert PROCESS_GROUP.claim("j") is None  # the older forming's rank
    claimed: list[str | None] = []
    try:
        assert PROCESS_GROUP.claim("k") == "j"  # another job's rank is refused at once
        assert PROCESS_GROUP.claim("j", wait_s=0.01) == "j"  # not let go within the wait
        waiter = threading.Thread(target=lambda: claimed.append(PROCESS_GROUP.claim("j", 60.0)))
        waiter.start()
        waiter.join(timeout=0.5)  # the one wait for a duration: that it waits
        assert waiter.is_alive() and not claimed
    finally:
        PROCESS_GROUP.release("j")  # the old rank leaves
    waiter.join(timeout=60)
    assert claimed == [None] and PROCESS_GROUP.job == "j"  # the new rank holds it
    PROCESS_GROUP.release("j")


def test_gloo_listens_on_the_interface_of_the_workers_address(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.1") is None  # no interface holds it (TEST-NET-1)
    assert interface_of("a-host-name") is None
    monkeypatch.delenv(GLOO_INTERFACE, raising=False)
    gloo_on("192.0.2.1")
    assert GLOO_INTERFACE not in os.environ  # left to gloo
    gloo_on("127.0.0.1")
    assert os.environ[GLOO_INTERFACE] == "lo"
    monkeypatch.setenv(GLOO_INTERFACE, "eth-chosen")
    gloo_on("127.0.0.1")
    assert os.environ[GLOO_INTERFACE] == "eth-chosen"  # an operator's choice stays
