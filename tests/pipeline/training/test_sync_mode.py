"""The synchronous mode (AntDT-DD) end to end: a LocalCluster of Nanny-managed worker processes,
one gloo rank per worker, the tables sharded across them, real Parquet, TorchRec and MLflow; a
rank's process killed for real, a rank hung in a collective.

The fault tests wait for events, never for a speed: the ranks pause (held between two leases,
the job cannot end) until a checkpoint is written, then go on to a hang at a row count. A hang
fires at the end of a step that trained rows, and no checkpoint can be taken past it (the next
step boundary needs the hung rank), so rows trained past the last checkpoint are replayed
whatever the timing: the ranks that stop report their rows as they leave."""

from __future__ import annotations

import ast
import contextlib
import math
import os
import signal
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import dask.config
import mlflow
import psutil
import pytest
import yaml
from dask.utils import format_bytes
from distributed import Client, Event, LocalCluster

from antdt.errors import ConfigError, JobError
from antdt.jobs import JobClient, checkpoints
from data.schema import Schema
from data.synth import SynthResult
from models.shards import ShardFiles
from models.train_step import model_bytes
from pipeline.job.config import load_job
from pipeline.training.cluster import replica_bytes, run, train_async
from pipeline.training.following import outcome
from pipeline.training.recipes import rank_memory
from waits import bounded

TRAIN_ROWS = 16_000
"""Rows of the two training days of ``small_data``."""

FAST = {"antdt.sharding.lease-wait": "200ms", "antdt.agent.report-interval": "200ms",
        "antdt.controller.interval": "200ms", "antdt.monitor.window": "500ms",
        "antdt.sync-steps.collective-timeout": "30s"}
"""Quicker end of job, progress reports and controller than the defaults (tiny data). A hung
rank is found within 30 s (the workers take it when the cluster starts): no healthy collective
of these jobs waits that long for a peer even on a loaded machine, where a shorter timeout
could break a group that is only slow (and an injected fault would then never fire: the group
formed again has none)."""

JOB_EVENT_S = 240.0
"""The bound on waiting for an event of a running job: only a hang takes that long."""

SHARD_ROWS = 1024
"""``sync_job``'s shards: a lease holds at most that many rows."""
LOCAL_BATCH = 256
"""A rank's local batch in ``sync_job`` on two workers with equal local batches."""


@pytest.fixture
def sync_job(cluster_job: Path, tmp_path: Path) -> Iterator[Path]:
    """``cluster_job`` in the synchronous mode: a global batch of 512 rows (256 a rank at the
    start on two workers), shards of 1,024 rows, checkpoints every 1,024 rows."""
    raw = yaml.safe_load(cluster_job.read_text())
    raw["train"].update(mode="sync", batch_size=2 * LOCAL_BATCH, shard_rows=SHARD_ROWS,
                        checkpoint_dir=str(tmp_path / "checkpoints"), checkpoint_every=1024)
    raw["train"].pop("sync_period")
    cluster_job.write_text(yaml.safe_dump(raw))
    yield cluster_job


def with_faults(path: Path, faults: list[dict[str, object]], **train: object) -> Path:
    raw = yaml.safe_load(path.read_text())
    raw["faults"] = faults
    raw["train"].update(train)
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Two single-thread Nanny workers, shared by the module's jobs (a killed one restarts)."""
    with dask.config.set(FAST), LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                             dashboard_address=":0") as local:
        local.wait_for_workers(2)
        yield local


@pytest.mark.slow
def test_a_sync_job_trains_every_row_once_and_gives_a_slow_rank_a_smaller_batch(
        cluster: LocalCluster, sync_job: Path) -> None:
    """Two epochs, rank 1 four times slower: every row trained once, the run tracked in sync
    mode, and the controller's batch policy moved rows of each global batch from the slow rank
    to the other (rank 0 makes the sizes sum to the global batch: ``shares``)."""
    job = load_job(with_faults(sync_job, [{"worker": 1, "slowdown": 4.0}], epochs=2))
    # the policy acts once a monitor window closed with both ranks' steps in it (windows are
    # the product's rule, in seconds): short windows, so that even a fast machine's job of
    # 63 steps spans several; a loaded machine only makes the steps, and the job, longer
    with dask.config.set({**FAST, "antdt.monitor.window": "200ms"}):
        summary = bounded.call(train_async, job, scheduler=cluster.scheduler_address)
    assert summary.mode == "sync" and summary.workers == 2
    assert summary.rows_trained == 2 * TRAIN_ROWS
    assert summary.rows_lost == summary.rows_retrained == summary.rows_quarantined == 0
    assert summary.auc > 0.6
    client = mlflow.MlflowClient(summary.tracking_uri)
    run = client.get_run(summary.run_id)
    assert run.data.tags["antdt.mode"] == "sync"
    # every step trains the whole global batch but the job's last (an epoch's last rows share
    # a step with the next epoch's first): no step of a slow rank's leftovers alone (a few
    # tiny steps at an epoch's end cost the model 0.01 AUC)
    steps = {run.data.metrics[f"worker{i}.sync_exchanges"] for i in range(2)}
    assert steps == {math.ceil(2 * TRAIN_ROWS / 512)}, steps
    actions = yaml.safe_load(Path(client.download_artifacts(
        summary.run_id, "straggler_actions.yaml")).read_text())
    last = {a["worker"]: a["size"] for a in actions if a["action"] == "adjust_batch"}
    assert len(last) == 2, actions
    slow, fast = sorted(last)[1], sorted(last)[0]  # faults name workers in address order
    assert last[slow] < 256 < last[fast], last


@contextlib.contextmanager
def gate(client: Client) -> Iterator[str]:
    """The name of a Dask event that pauses the ranks (faults ``pause_until``), set when the
    block ends whatever its outcome: a failed test leaves no job held on the cluster."""
    name = f"gate-{uuid.uuid4().hex}"
    try:
        yield name
    finally:
        Event(name, client=client).set()


def paused(gate: str, after_rows: int, **faults: object) -> dict[str, object]:
    """Faults that pause a rank between two leases once it trained ``after_rows`` rows, until
    the event ``gate`` is set (it goes on stepping: its peers do not time out)."""
    return {"pause_after_rows": after_rows, "pause_until": gate, **faults}


def held_rows(after_rows: int) -> int:
    """A rank paused after ``after_rows`` rows trains fewer than this before the pause holds
    it: the rest of the lease it passed them in, or of the lease it asked ahead (at most a
    shard) less than a local batch before the end of the one before."""
    return after_rows + SHARD_ROWS + LOCAL_BATCH


def new_job(jobs: JobClient, known: set[str]) -> str | None:
    """The id of the job the scheduler knows besides ``known`` (None until it is submitted)."""
    return next((r["job_id"] for r in jobs.status() if r["job_id"] not in known), None)


def held_at_a_checkpoint(jobs: JobClient, job_id: str) -> int:
    """Wait until the paused job has a complete checkpoint (its manifest written); the rows it
    trained by then."""
    bounded.until(lambda: jobs.status(job_id)["checkpoint"],
                  "a checkpoint written while the ranks pause", JOB_EVENT_S)
    return int(jobs.status(job_id)["rows"]["trained"])


def logged(jobs: JobClient, job_id: str, start: str, source: str | None = None) -> bool:
    """Whether the job's log has a line starting with ``start`` (from ``source``, if given)."""
    return any(r["message"].startswith(start) and (source is None or r["source"] == source)
               for r in jobs.logs(job_id))


def test_a_killed_rank_forms_the_group_again_from_the_checkpoint(cluster: LocalCluster,
                                                                  sync_job: Path) -> None:
    """Both ranks pause after 1,024 rows until a checkpoint is written; then rank 1 hangs
    after 3,072 rows (past its pause: ``held_rows``) and its process is SIGKILLed there: rank
    0's collective fails, the master forms the group again from that checkpoint or a later one on
    the workers there (the nanny restarts the dead one), and the job ends with every row
    trained and none lost. Rank 0 reports the rows of the step rank 1 hung after as it leaves:
    trained past every checkpoint, they are replayed. Equal local batches: the faults' row
    counts are reached whatever the ranks' speeds."""
    with dask.config.set(FAST), Client(cluster.scheduler_address) as client, \
            JobClient(client) as jobs, gate(client) as go:
        pids = client.run(os.getpid)
        rank1 = sorted(pids)[1]  # faults name workers in address order, as ranks are
        job = load_job(with_faults(sync_job, [
            {"worker": 0, **paused(go, 1024)},
            {"worker": 1, **paused(go, 1024, hang_after_rows=3072)}],
            epochs=2, adaptive_batch=False))
        known = {r["job_id"] for r in jobs.status()}
        started = bounded.start(train_async, job, scheduler=cluster.scheduler_address)
        job_id = bounded.until(lambda: new_job(jobs, known), "the job's submission", JOB_EVENT_S)
        held = held_at_a_checkpoint(jobs, job_id)
        Event(go, client=client).set()
        bounded.until(lambda: logged(jobs, job_id, "injected hang after", rank1),
                      "rank 1's hang", JOB_EVENT_S)
        os.kill(pids[rank1], signal.SIGKILL)
        summary = started.result()
        logs = [r["message"] for r in jobs.logs(job_id)]
    assert held < 2 * held_rows(1024)  # the pauses held the job
    assert summary.rows_lost == 0 and summary.rows_quarantined == 0
    assert summary.rows_replayed > 0
    assert summary.rows_trained == 2 * TRAIN_ROWS
    assert any(line.startswith("restarting from checkpoint ") for line in logs), logs
    assert not math.isnan(summary.auc) and summary.auc > 0.55


@pytest.mark.slow
def test_a_hung_rank_breaks_the_step_within_the_timeout_and_the_job_ends(
        cluster: LocalCluster, sync_job: Path) -> None:
    """Rank 0 stops making progress after 2,048 rows: rank 1's collective times out, the
    master stops both and forms the group again; the job does not hang and loses no row. The
    rows of the step rank 0 hung after are past every checkpoint (none can be taken after it)
    and both ranks report them as they stop: they are replayed, whether the master took a
    checkpoint before the hang or not. Equal local batches: rank 0 reaches 2,048 rows whatever
    the ranks' speeds."""
    job = load_job(with_faults(sync_job, [{"worker": 0, "hang_after_rows": 2048}],
                               adaptive_batch=False))
    with dask.config.set(FAST):
        record = bounded.call(run, job, scheduler=cluster.scheduler_address)
        with Client(cluster.scheduler_address) as client, \
                JobClient(client, register=False) as jobs:
            logs = jobs.logs(record["job_id"])
    summary = outcome(record)
    assert summary.rows_lost == 0 and summary.rows_trained == TRAIN_ROWS
    assert summary.rows_replayed > 0
    messages = [r["message"] for r in logs]
    assert sum(m.startswith("injected hang after ") for m in messages) == 1, messages
    # the hang broke the group: rank 1 gave up waiting for rank 0 in the next step's header,
    # and rank 0, hung, stopped when the master told it to
    assert any(m.startswith("agent 1 on ") and "the step's header failed" in m
               for m in messages), messages
    assert any(m.startswith("agent 0 on ") and " cancelled: " in m for m in messages), messages


@pytest.mark.parametrize("limit, pause", [("4GiB", 0.8), ("4GiB", False), (None, 0.8)])
def test_a_ranks_room_is_the_workers_limit_up_to_its_pause_less_what_it_holds(
        limit: str | None, pause: float | bool) -> None:
    """Below the pause (or, without one, the nanny's 95%), less the process's own memory; no
    limit: None (the planner shares the machine); a limit already used up: refused."""
    with dask.config.set({"distributed.worker.memory.pause": pause}), \
            LocalCluster(n_workers=1, processes=False, memory_limit=limit,
                         dashboard_address=":0") as local:
        worker = next(iter(local.workers.values()))
        held = worker.monitor.get_process_memory()
        room = rank_memory(worker)
        if limit is None:
            assert room is None
            return
        usable = (pause or 0.95) * 4 * 2**30
        assert room is not None and abs(room - (usable - held)) < 64 * 2**20
        worker.memory_manager.memory_limit = held
        with pytest.raises(ConfigError, match=r"its memory limit .* \(up to \d+% of it usable\) "
                                              r"leaves nothing for the model's shards beside "
                                              r"the .* its process holds already"):
            rank_memory(worker)


class PeakRss:
    """The highest resident memory each process reached, sampled every 20 ms in a thread (the
    nanny looks every 100 ms) until :meth:`stop`."""

    def __init__(self, pids: Iterable[int]) -> None:
        self.processes = {pid: psutil.Process(pid) for pid in pids}
        self.peaks = dict.fromkeys(self.processes, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            for pid, process in self.processes.items():
                with contextlib.suppress(psutil.NoSuchProcess):
                    self.peaks[pid] = max(self.peaks[pid], process.memory_info().rss)

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join(timeout=10)
        return dict(self.peaks)


def big_schema(small_data: SynthResult, tmp_path: Path, rows: int) -> tuple[dict[str, Any], Path]:
    """``small_data``'s schema with ``rows`` rows in each of the tables of its last six
    features (their ids hashed into that many buckets), and where it was written."""
    schema = Schema.from_yaml(Path(small_data.out) / "schema.yaml").to_dict()
    for feature in schema["sparse"][2:]:
        feature["num_embeddings"] = rows
    path = tmp_path / "big-schema.yaml"
    path.write_text(yaml.safe_dump(schema))
    return schema, path


def parts_of(ranks: int) -> set[str]:
    """The files of a model written in parts by ``ranks`` ranks (:mod:`models.shards`)."""
    return {f"model-{rank:05d}-of-{ranks:05d}.bin" for rank in range(ranks)} | {"model-dense.pt"}


LIMIT = 2 * 2**30
"""Each worker's Dask memory limit in the big-tables test: it pauses at 80% (1.6 GiB), and its
nanny restarts it at 95%."""
BIG_ROWS = 11_000_000
"""Rows of each of six tables in the big-tables test: 6 x 11M x 8 floats and row-wise
Adagrad's float per row, 2.21 GiB, more than a worker's limit. A worker's process holds about
0.66 GiB before any shard (torch, TorchRec, MLflow's store imported), so each rank has room for
about 0.8 GiB of shards below the pause: three ranks hold them."""


@pytest.mark.slow
def test_tables_larger_than_a_worker_train_in_sync_mode_and_async_is_refused(
        sync_job: Path, small_data: SynthResult, tmp_path: Path) -> None:
    """Three workers limited to 2 GiB each train 2.21 GiB of tables in sync mode: every rank
    builds only its shards, the final model is written in parts by the ranks, no worker is
    paused or restarted; the same job in async mode is refused in one line. (Checkpoints are
    written the same way: see the next test.)"""
    schema, big = big_schema(small_data, tmp_path, BIG_ROWS)
    job = load_job(sync_job, [f"data.schema={big}", "train.epochs=2",
                              f"train.checkpoint_every={10**9}"])
    size = model_bytes(Schema.from_dict(schema), job.model, job.train.optim)
    assert size.tables + size.sparse_state > LIMIT
    with dask.config.set(FAST), LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                                             memory_limit=LIMIT, dashboard_address=":0"
                                             ) as local, Client(local) as client:
        client.wait_for_workers(3, timeout=60)
        pids = client.run(os.getpid)
        watch = PeakRss(pids.values())
        record = bounded.call(run, job, scheduler=local.scheduler_address)
        peaks = watch.stop()
        assert client.run(os.getpid) == pids  # no worker was restarted
        with JobClient(client, register=False) as jobs:
            logs = [r["message"] for r in jobs.logs(record["job_id"])]
        async_job = load_job(sync_job, [f"data.schema={big}", "train.mode=async",
                                        "model.tables=replicated"])
        with pytest.raises(JobError) as refused:  # at submit: no job starts
            bounded.call(run, async_job, scheduler=local.scheduler_address)

    summary = outcome(record)
    assert summary.mode == "sync" and summary.workers == 3
    assert summary.rows_trained == 2 * TRAIN_ROWS
    assert summary.rows_lost == summary.rows_retrained == summary.rows_replayed == 0
    # every rank stayed below the worker's pause (80% of its limit), let alone the nanny's 95%
    assert max(peaks.values()) < 0.8 * LIMIT, sorted(peaks.values())
    # the planner split the tables: each rank holds some of them, none holds them all
    plans = [ast.literal_eval(line.partition("tables: ")[2].partition("; ")[0])
             for line in logs if " of 3 (gloo); tables: " in line]
    assert len(plans) == 3 and plans[0] == plans[1] == plans[2], logs
    holders = [sharding.partition(" ")[2] for name, sharding in plans[0].items()
               if name in {f["name"] for f in schema["sparse"][2:]}]
    assert {"[0]", "[1]", "[2]"} <= set(holders), plans[0]

    folder = Path(job.train.checkpoint_dir or "") / record["job_id"]
    assert summary.model_dir == str(folder / "model")
    final = ShardFiles(summary.model_dir, parts_of(3))
    assert final.dense()["rows_trained"] == 2 * TRAIN_ROWS
    assert sum(f.stat().st_size for f in (folder / "model").iterdir()) > LIMIT

    worker = sorted(pids)[0]
    need = replica_bytes(Schema.from_dict(schema), async_job.model, async_job.train.optim)
    assert str(refused.value) == (
        f"the model needs {format_bytes(need)} per worker in async mode (every worker holds a "
        f"full replica), but worker {worker}'s memory limit is 2.00 GiB (3 of the job's 3 "
        f"workers have less than it needs); shard its tables over the workers (model.tables: "
        f"sharded or auto), train it with --mode sync, or give the workers more memory")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_group_whose_model_is_kept_in_parts_forms_again_from_its_parts(
        sync_job: Path, small_data: SynthResult, tmp_path: Path) -> None:
    """Workers limited to 1.25 GiB could not gather 0.3 GiB of tables (a gather holds the
    model three times over): every checkpoint is written in parts by the ranks. Both ranks
    pause after 2,048 rows (4,096 trained between them: a checkpoint is due) until one is
    written; then rank 0 hangs after 4,096 rows (past its pause: ``held_rows``), rank 1's
    collective times out, the master stops both and forms the group again from the last
    checkpoint's parts (each rank reading its own shards), and the job ends with no row lost
    and every row in the model once. Equal local batches: rank 0 reaches 4,096 rows whatever
    the ranks' speeds."""
    _, big = big_schema(small_data, tmp_path, 1_500_000)
    with dask.config.set(FAST), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                         memory_limit=1.25 * 2**30, dashboard_address=":0") as local, \
            Client(local) as client, JobClient(client) as jobs, gate(client) as go:
        job = load_job(with_faults(sync_job, [
            {"worker": 0, **paused(go, 2048, hang_after_rows=4096)},
            {"worker": 1, **paused(go, 2048)}], adaptive_batch=False),
            [f"data.schema={big}", "train.checkpoint_every=4096"])
        started = bounded.start(run, job, scheduler=local.scheduler_address, timeout_s=480)
        job_id = bounded.until(lambda: new_job(jobs, set()), "the job's submission",
                               JOB_EVENT_S)
        held = held_at_a_checkpoint(jobs, job_id)
        Event(go, client=client).set()
        record = started.result()
        logs = [r["message"] for r in jobs.logs(job_id)]
    assert held < 2 * held_rows(2048)  # the pauses held the job
    summary = outcome(record)
    assert summary.rows_lost == summary.rows_quarantined == 0
    assert summary.rows_replayed > 0 and summary.rows_trained >= TRAIN_ROWS
    assert any(line.startswith("restarting from checkpoint ") for line in logs), logs
    folder = Path(job.train.checkpoint_dir or "") / record["job_id"]
    written = [checkpoints.verify(str(version)) for version in sorted(folder.glob("v*"))]
    assert written and all(set(m.files) == parts_of(2) | {"ledger.bin"} for m in written)
    assert summary.model_dir == str(folder / "model")
    # the model holds every row once: the parts it resumed from, then the rows after them
    assert ShardFiles(summary.model_dir, parts_of(2)).dense()["rows_trained"] == TRAIN_ROWS
