"""The sharding handlers believe nothing a caller cannot back: synced rows beyond what the
worker's commits counted, negative measurements, checkpoints outside the job's folder, too
large or not a checkpoint at all (and an error never shows a file's bytes); a registration
builds its ledger off the scheduler's event loop."""

from __future__ import annotations

import os
import threading
from typing import Any
from unittest import mock

import dask.config
import pytest
from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

from antdt.errors import LedgerError
from antdt.sharding import ShardLedger, checkpoint
from antdt.sharding import service as sharding_service
from antdt.sharding.service import PLUGIN_NAME, ShardingService

GROUPS = [["a.parquet", 0, 20]]


async def register(c: Client, s: Scheduler, job: str = "j") -> ShardingService:
    if PLUGIN_NAME not in s.plugins:
        await c.register_plugin(ShardingService())
    reply = await c.scheduler.antdt_register_job(job=job, row_groups=GROUPS, shard_rows=10,
                                                 batch_rows=2)
    assert reply["status"] == "OK", reply
    plugin = s.plugins[PLUGIN_NAME]
    assert isinstance(plugin, ShardingService)
    return plugin


@gen_cluster(client=True)
async def test_synced_rows_beyond_what_the_workers_commits_counted_are_refused(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    plugin = await register(c, s)
    lease = (await c.scheduler.antdt_lease(job="j", worker=a.address, wait_s=0))["lease"]
    # nothing committed yet: a report of one synced row is more than the ledger knows
    early = await c.scheduler.antdt_commit(job="j", commits=[], worker=a.address, synced_rows=1)
    assert early["status"] == "error" and "exceed the rows its commits counted synced (0)" in \
        early["message"], early
    done = {"lease_id": lease["lease_id"], "token": lease["token"], "offset": 2,
            "synced_offset": 2}
    ok = await c.scheduler.antdt_commit(job="j", commits=[done], worker=a.address,
                                        synced_rows=2)
    assert ok["status"] == "OK" and ok["replies"][0]["kind"] == "claim", ok
    inflated = await c.scheduler.antdt_lease(job="j", worker=a.address, synced_rows=10**6,
                                             wait_s=0)
    assert inflated["status"] == "error" and "(1000000) exceed" in inflated["message"]
    assert plugin.jobs["j"].synced_rows(a.address) == 2  # the real count stands
    # the worker's own next report, as its agent sends it, is still accepted
    more = {**done, "offset": lease["claim_stop"], "synced_offset": lease["claim_stop"]}
    again = await c.scheduler.antdt_commit(job="j", commits=[more], worker=a.address,
                                           synced_rows=lease["claim_stop"] - lease["start"])
    assert again["status"] == "OK", again
    other = await c.scheduler.antdt_commit(job="j", commits=[], worker=b.address, synced_rows=2)
    assert other["status"] == "error"  # a's rows are not b's


@gen_cluster(client=True)
async def test_negative_or_impossible_stats_are_refused(c: Client, s: Scheduler, a: Worker,
                                                        b: Worker) -> None:
    plugin = await register(c, s)
    lease = (await c.scheduler.antdt_lease(job="j", worker=a.address, wait_s=0))["lease"]
    item = {"lease_id": lease["lease_id"], "token": lease["token"], "offset": 2,
            "synced_offset": 2}
    for stats in ({"batches": -1}, {"busy_s": -0.5}, {"busy_s": float("nan")}):
        reply = await c.scheduler.antdt_commit(job="j", commits=[{**item, "stats": stats}])
        assert reply["replies"][0]["kind"] == "error", (stats, reply)
        assert "finite number >= 0" in reply["replies"][0]["message"]
    assert plugin.jobs["j"].rows_trained == 0  # a refused commit changes nothing
    good = await c.scheduler.antdt_commit(job="j", commits=[{**item, "stats": {"batches": 1}}])
    assert good["replies"][0]["kind"] == "claim" and plugin.jobs["j"].rows_trained == 2


@gen_cluster(client=True)
async def test_a_registration_builds_its_ledger_off_the_event_loop(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    built_on: list[int] = []

    class Recorded(ShardLedger):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built_on.append(threading.get_ident())
            super().__init__(*args, **kwargs)

    with mock.patch.object(sharding_service, "ShardLedger", Recorded):
        await register(c, s)
    assert built_on and threading.get_ident() not in built_on  # this test runs on the loop


@gen_cluster(client=True, nthreads=[])
async def test_checkpoints_stay_in_the_jobs_folder_and_errors_show_no_bytes(
        c: Client, s: Scheduler) -> None:
    await register(c, s)
    root = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"trust-{os.getpid()}-{id(s)}")
    with dask.config.set({"antdt.sharding.checkpoint-root": root}):
        for path in ("/etc/hostname", f"{root}/j/../x", f"{root}/jj/x", f"{root}/kk/x", root,
                     "relative/j/x", f"{root}/j/../k/x"):
            for handler, job in (("antdt_checkpoint", "j"), ("antdt_restore", "k")):
                if handler == "antdt_restore" and path.endswith("/k/x"):
                    path = f"{root}/k/../j/x"
                reply = await getattr(c.scheduler, handler)(job=job, path=path)
                assert reply["status"] == "error" and "outside the job's checkpoint folder" \
                    in reply["message"], (handler, path, reply)
        os.makedirs(f"{root}/k")
        with open(f"{root}/k/secret", "wb") as f:
            f.write(b"SECRET-BYTES" * 4)
        with open(f"{root}/k/damaged", "wb") as f:
            f.write(checkpoint.MAGIC + b"\xff\xff\xff\x7fSECRET")
        for name in ("secret", "damaged"):
            reply = await c.scheduler.antdt_restore(job="k", path=f"{root}/k/{name}")
            assert reply["status"] == "error" and f"k/{name}" in reply["message"], reply
            assert "SECRET" not in reply["message"], reply
        saved = await c.scheduler.antdt_checkpoint(job="j", path=f"{root}/j/ledger.bin")
        assert saved["status"] == "OK", saved
        with mock.patch.object(sharding_service, "MAX_BYTES", saved["bytes"] - 1):
            big = await c.scheduler.antdt_restore(job="j2", path=f"{root}/j/ledger.bin")
        assert big["status"] == "error" and "outside" in big["message"]  # j2's folder is j2/
        os.rename(f"{root}/j", f"{root}/j2")
        with mock.patch.object(sharding_service, "MAX_BYTES", saved["bytes"] - 1):
            big = await c.scheduler.antdt_restore(job="j2", path=f"{root}/j2/ledger.bin")
        assert big["status"] == "error" and "larger than a ledger checkpoint may be" in \
            big["message"], big
        restored = await c.scheduler.antdt_restore(job="j2", path=f"{root}/j2/ledger.bin")
        assert restored["status"] == "OK" and restored["total_rows"] == 20


def test_decode_names_no_bytes_and_read_is_bounded(tmp_path: Any) -> None:
    for data in (b"SECRET!!" + b"x" * 20, checkpoint.MAGIC + b"\x05\x00\x00\x00SECRET",
                 checkpoint.MAGIC + b"\x02\x00\x00\x00{}"):
        with pytest.raises(LedgerError) as refused:
            ShardLedger.from_bytes(data, clock=lambda: 0.0)
        assert "SECRET" not in str(refused.value)
    path = tmp_path / "big"
    path.write_bytes(b"0" * 100)
    with pytest.raises(LedgerError, match="larger than a ledger checkpoint may be"):
        checkpoint.read(str(path), limit=99)
    assert checkpoint.read(str(path), limit=100) == b"0" * 100
