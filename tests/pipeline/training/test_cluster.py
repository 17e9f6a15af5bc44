"""Cluster jobs from the application's side, end to end: LocalClusters of Nanny-managed worker
processes with the job service on their scheduler, real Parquet, TorchRec, a real MLflow store;
a worker process killed for real; the async mode with its tables sharded over the workers
(``model.tables: sharded``), one of their hosts killed for real."""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask.config
import mlflow
import psutil
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner
from dask.utils import format_bytes, parse_timedelta
from distributed import Client, Event, LocalCluster

from antdt import agent
from antdt.errors import ConfigError, DataError
from antdt.jobs import JobClient
from antdt.sharding.service import PLUGIN_NAME
from antdt.jobs.spec import PLUGIN_NAME as JOBS
from antdt.tables.service import PLUGIN_NAME as TABLES
from broken_files import break_label
from commands import antdt
from data.files import expand, row_groups
from data.schema import Schema
from data.synth import SynthResult
from models.evaluate import auc
from pipeline.cli.main import cli
from pipeline.job.config import load_job
from pipeline.training.cluster import replica_bytes, train_async
from pipeline.training.local_cluster import connect, local_cluster_settings
from waits import bounded

TRAIN_ROWS = 16_000
"""Rows of the two training days of ``small_data``."""

FAST = {"antdt.sharding.lease-wait": "200ms", "antdt.agent.report-interval": "200ms"}
"""Quicker end of job and progress reports than the defaults (tiny data, short jobs)."""


@pytest.fixture(scope="module")
def shared_cluster() -> Iterator[LocalCluster]:
    """Two single-thread Nanny workers, shared by the tests that pass ``--scheduler``."""
    with dask.config.set(FAST), LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                             dashboard_address=":0") as local:
        yield local


@pytest.fixture
def cluster(shared_cluster: LocalCluster) -> LocalCluster:
    """The shared cluster once it holds its two workers again: a worker an earlier test killed
    comes back when its nanny restarted it, and a job's faults name workers by index."""
    bounded.until(lambda: len(shared_cluster.scheduler.workers) >= 2, "the cluster's 2 workers")
    return shared_cluster


def scheduler_workers(client: Client) -> list[str]:
    return sorted(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


def workers_of(cluster: LocalCluster) -> list[str]:
    with Client(cluster.scheduler_address) as client:
        client.wait_for_workers(2, timeout=60)
        return scheduler_workers(client)


def test_cli_trains_async_on_two_workers_and_tracks_the_run(cluster_job: Path) -> None:
    with dask.config.set(FAST):
        result = bounded.call(CliRunner().invoke, cli, [
            "train", str(cluster_job), "--workers", "2", "--json", "--set", "train.epochs=2",
            "--set", "train.sync_period=2 batches", "--register", "small-async"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"run_id", "auc", "logloss", "oracle_auc", "rows_trained", "rows_lost",
            "rows_retrained", "rows_quarantined", "wall_s", "samples_per_s", "workers",
            "straggler_actions"} <= set(summary)
    assert (summary["registered_model"], summary["registered_version"]) == ("small-async", "1")
    assert summary["mode"] == "async" and summary["workers"] == 2
    assert summary["rows_trained"] == 2 * TRAIN_ROWS
    assert summary["rows_lost"] == summary["rows_retrained"] == summary["rows_quarantined"] == 0
    assert summary["auc"] > 0.6
    assert summary["samples_per_s"] > 0 and summary["wall_s"] > 0
    phases = summary["phases"]  # where the command's seconds went
    steps = {"start", "prepare", "cluster", "workers", "plan", "first lease", "training",
             "evaluate", "metrics", "timeline", "model", "results", "shutdown"}
    assert set(phases) == steps | {"total_s", "outside_s"}
    assert sum(phases[step] for step in steps) == pytest.approx(phases["total_s"], abs=0.02)
    assert phases["outside_s"] == pytest.approx(phases["total_s"] - summary["train_s"], abs=0.01)
    assert phases["training"] > 0 and phases["model"] > 0

    job = load_job(cluster_job)
    mlflow.set_tracking_uri(job.mlflow.tracking_uri)
    run = mlflow.get_run(summary["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.mode"] == "async"
    assert run.data.metrics["auc"] == pytest.approx(summary["auc"])
    assert run.data.metrics["ledger.rows_done"] == 2 * TRAIN_ROWS
    assert run.data.metrics["agents_dead"] == 0
    assert run.data.metrics["straggler_actions"] == summary["straggler_actions"]
    # the summary figures are the job's own, never a tick's (the last tick trains nothing)
    assert run.data.metrics["samples_per_s"] == pytest.approx(summary["samples_per_s"])
    assert run.data.metrics["rows_trained"] == summary["rows_trained"]
    history = mlflow.MlflowClient().get_metric_history(summary["run_id"], "train.rows_done")
    assert len(history) >= 2 and history[-1].value == 2 * TRAIN_ROWS
    actions = mlflow.MlflowClient().get_metric_history(summary["run_id"], "controller.actions")
    assert actions and actions[-1].value == summary["straggler_actions"]
    assert_timeline(summary["run_id"])
    assert mlflow.MlflowClient().get_metric_history(summary["run_id"], "train.loss")
    assert {"train.samples_per_s.worker0", "train.samples_per_s.worker1"} & set(run.data.metrics)
    assert {"worker0.rows", "worker1.rows"} <= set(run.data.metrics)
    assert run.data.metrics["worker0.rows"] + run.data.metrics["worker1.rows"] == 2 * TRAIN_ROWS
    assert run.data.params["train.sync_period"] == "2 batches"
    assert run.data.metrics["worker0.batches"] + run.data.metrics["worker1.batches"] >= \
        2 * TRAIN_ROWS / job.train.batch_size
    # rounds started by trained batches, plus the final round
    assert min(run.data.metrics[f"worker{i}.sync_exchanges"] for i in (0, 1)) >= 2
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(summary["run_id"])}
    assert {"job.yaml", "schema.yaml"} <= artifacts
    model = mlflow.pyfunc.load_model(f"runs:/{summary['run_id']}/model")
    frame = pq.read_table(expand(list(job.data.validation))).to_pandas()
    assert auc(frame["label"].to_numpy(), model.predict(frame)) == pytest.approx(summary["auc"],
                                                                                 abs=1e-4)
    # registered from the worker that finished the job, tagged with its figures and data
    version = mlflow.MlflowClient().get_model_version("small-async", "1")
    assert version.run_id == summary["run_id"]
    assert float(version.tags["antdt.auc"]) == pytest.approx(summary["auc"])
    assert (version.tags["antdt.mode"], version.tags["antdt.workers"]) == ("async", "2")
    assert int(version.tags["antdt.rows_trained"]) == 2 * TRAIN_ROWS
    assert json.loads(version.tags["antdt.data.validation"]) == list(job.data.validation)
    assert version.tags["antdt.data.train_files"] == "4"
    assert version.tags["antdt.data.fingerprint"] == run.data.tags["antdt.data.fingerprint"]


def assert_timeline(run_id: str) -> None:
    """The run has its timeline PNG."""
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run_id)}
    assert "timeline.png" in artifacts
    png = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="timeline.png")
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


STRAGGLER_CONTROL = {
    **FAST,
    "antdt.monitor.window": "300ms", "antdt.monitor.persistent-windows": 3,
    "antdt.monitor.slow-factor": 3.0, "antdt.monitor.warm-up-batches": 4,
    "antdt.sharding.commit-interval": "50ms",
    "antdt.controller.interval": "200ms", "antdt.controller.min-workers": 2,
    "antdt.controller.policies": [
        {"class": "antdt.controller.RevokeHung"}, {"class": "antdt.controller.ReassignStragglers"},
        {"class": "antdt.controller.RetirePersistent", "max_fraction": 1.0}],
}
"""Windows and commits short enough for a job of seconds, and persistent stragglers retired.
The rule is the product's and it is timing: a worker is slow in a window when its batch time
is above ``slow-factor`` x its peers' median. At 3x for 3 windows of 300 ms, a loaded machine
cannot make a healthy worker look persistent (it would need three times its peers' batch time
for about a second, with the 8x straggler among those peers); the straggler, 8x slower, is
slow in every window whatever the load."""


@pytest.mark.slow
def test_a_persistent_straggler_loses_its_rows_and_is_retired(cluster_job: Path) -> None:
    """Worker 0 is 8x slower: the controller moves its rows and retires it (its process really
    exits); the others finish the job without losing a row. They pause, holding no lease, once
    each trained 40% of the job, until the straggler is gone, so the job cannot end first: its
    verdict needs its warm-up (they train 8x its batches meanwhile) and three windows."""
    gone = f"straggler-gone-{uuid.uuid4().hex}"
    pause = 6 * TRAIN_ROWS * 2 // 5
    with dask.config.set(STRAGGLER_CONTROL), \
            LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                         dashboard_address=":0") as local, Client(local) as client:
        local.wait_for_workers(3)
        pids = client.run(os.getpid)
        victim = sorted(pids)[0]
        job = load_job(cluster_job, [
            "train.epochs=6", "train.batch_size=256", "train.shard_rows=2048",
            f"faults=[{{worker: 0, slowdown: 8}}, "
            f"{{worker: 1, pause_after_rows: {pause}, pause_until: {gone}}}, "
            f"{{worker: 2, pause_after_rows: {pause}, pause_until: {gone}}}]"])
        run = bounded.start(train_async, job, scheduler=local.scheduler_address)
        bounded.until(lambda: victim not in scheduler_workers(client) or run.done(),
                      "the straggler retired", timeout_s=180)
        Event(gone, client=client).set()
        summary = run.result()
        survivors = client.sync(client.scheduler.identity, n_workers=-1)["workers"]

    assert summary.rows_lost == 0
    assert summary.rows_trained == 6 * TRAIN_ROWS + summary.rows_retrained
    mlflow.set_tracking_uri(job.mlflow.tracking_uri)
    path = mlflow.artifacts.download_artifacts(run_id=summary.run_id,
                                               artifact_path="straggler_actions.yaml")
    actions = yaml.safe_load(Path(path).read_text())
    assert summary.straggler_actions == len(actions) >= 1
    # the run records the cluster's 3 workers, not the job file's train.workers (2)
    assert mlflow.get_run(summary.run_id).data.params["train.workers"] == "3"
    retired = [(a["worker"], re.search(r"persistent straggler: slow for (\d+) windows",
                                       a["reason"])) for a in actions if a["action"] == "retire"]
    assert [worker for worker, _ in retired] == [victim], actions
    assert all(found and int(found[1]) >= 3 for _, found in retired), actions
    assert victim not in survivors
    assert not psutil.pid_exists(pids[victim]) or \
        psutil.Process(pids[victim]).status() == psutil.STATUS_ZOMBIE
    assert_timeline(summary.run_id)


def test_a_worker_process_killed_mid_job_costs_no_row(cluster: LocalCluster,
                                                      cluster_job: Path) -> None:
    victim = workers_of(cluster)[0]
    gone = f"victim-gone-{uuid.uuid4().hex}"
    job = load_job(cluster_job, [
        "train.epochs=2",
        # worker 0's process exits after two batches; worker 1 waits until it is gone, so that
        # worker 0 surely gets that far
        f"faults=[{{worker: 0, crash_after_rows: 1024}}, {{worker: 1, pause_until: {gone}}}]"])
    run = bounded.start(train_async, job, scheduler=cluster.scheduler_address)
    with Client(cluster.scheduler_address) as client:
        bounded.until(lambda: victim not in scheduler_workers(client), "the victim's death")
        Event(gone, client=client).set()
    summary = run.result()

    assert summary.rows_lost == 0
    assert summary.rows_trained == 2 * TRAIN_ROWS + summary.rows_retrained
    assert summary.auc > 0.55
    mlflow.set_tracking_uri(job.mlflow.tracking_uri)
    run = mlflow.get_run(summary.run_id)
    assert run.data.metrics["agents_dead"] == 1
    # the survivor (and the nanny's replacement, if it joined in time) trained everything the
    # ledger counts, except what the victim committed of its 1,024 rows before it died
    reported = sum(v for k, v in run.data.metrics.items() if k.endswith(".rows"))
    assert 0 <= summary.rows_trained - reported <= 1024
    assert victim not in workers_of(cluster)  # the nanny restarted it under a new address


def test_a_job_with_sharded_tables_trains_every_row_once_and_logs_the_model(
        cluster: LocalCluster, cluster_job: Path) -> None:
    job = load_job(cluster_job, ["model.tables=sharded"])
    summary = bounded.call(train_async, job, scheduler=cluster.scheduler_address)

    assert summary.rows_trained == TRAIN_ROWS and summary.rows_lost == 0
    assert summary.rows_retrained == 0
    assert summary.auc > 0.55  # the model gathered from the hosts was evaluated
    mlflow.set_tracking_uri(job.mlflow.tracking_uri)
    assert mlflow.get_run(summary.run_id).info.status == "FINISHED"
    assert not cluster.scheduler.plugins[TABLES].maps  # the job's tables were forgotten with it
    # what status, the job page and /metrics show of them
    (runner,) = [r for r in cluster.scheduler.plugins[JOBS].runners.values()
                 if (r.run or {}).get("run_id") == summary.run_id]
    record = runner.record()
    tables = record["tables"]
    assert sum(h["primary"] for h in tables["held"].values()) == tables["buckets"]
    assert all(h["backup"] for h in tables["held"].values())  # two workers back each other up
    assert all(w["tables"]["pulls"] > 0 and w["tables"]["pushes"] > 0 for w in record["workers"])
    with Client(cluster.scheduler_address) as client, \
            JobClient(client, register=False) as jobs:
        page = jobs.page(runner.job_id)
        metrics_url = client.dashboard_link.replace("/status", "/metrics")
    assert page is not None
    with urllib.request.urlopen(page, timeout=30) as answer:
        assert 'id="buckets"' in answer.read().decode()
    with urllib.request.urlopen(metrics_url, timeout=30) as answer:
        assert f'dask_antdt_job_tables_buckets{{job_id="{runner.job_id}"' in answer.read().decode()


def test_a_killed_shard_host_is_served_by_its_backup_and_costs_no_row(
        cluster: LocalCluster, cluster_job: Path) -> None:
    with Client(cluster.scheduler_address) as client:
        client.wait_for_workers(2, timeout=60)
        victim = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]
    gone = f"victim-gone-{uuid.uuid4().hex}"
    job = load_job(cluster_job, [
        "model.tables=sharded", "train.epochs=2",
        f"faults=[{{worker: 0, crash_after_rows: 1024}}, {{worker: 1, pause_until: {gone}}}]"])
    run = bounded.start(train_async, job, scheduler=cluster.scheduler_address)
    plugins = cluster.scheduler.plugins
    with Client(cluster.scheduler_address) as client:
        bounded.until(lambda: TABLES in plugins and any(
            victim in m.departed for m in plugins[TABLES].maps.values()),
            "the victim's buckets failed over")
        service = plugins[TABLES]
        (placed,) = service.maps.values()
        assert victim not in placed.workers() and not placed.lost
        Event(gone, client=client).set()
    summary = run.result()

    assert summary.rows_lost == 0
    assert summary.rows_trained == 2 * TRAIN_ROWS + summary.rows_retrained
    assert summary.auc > 0.55


def test_a_retired_shard_host_drains_its_buckets_before_it_goes(cluster: LocalCluster,
                                                                 cluster_job: Path) -> None:
    """Both workers pause after 1,024 rows; Dask retires one (as ``Adaptive`` would): it drains
    its buckets while it still serves them (their backups promoted, new backups made) and the
    other trains the rest, every row once."""
    go = f"retired-{uuid.uuid4().hex}"
    job = load_job(cluster_job, [
        "model.tables=sharded", "train.shard_rows=512",
        f"faults=[{{worker: 0, pause_after_rows: 1024, pause_until: {go}}}, "
        f"{{worker: 1, pause_after_rows: 1024, pause_until: {go}}}]"])
    run = bounded.start(train_async, job, scheduler=cluster.scheduler_address)
    plugins = cluster.scheduler.plugins
    (job_id,) = bounded.until(lambda: PLUGIN_NAME in plugins and list(plugins[PLUGIN_NAME].jobs),
                              "the job's registration")
    with Client(cluster.scheduler_address) as client:
        bounded.until(lambda: sum(m.get("fault") == "pause" for _, m in
                                  client.get_events(agent.event_topic(job_id))) == 2,
                      "both workers paused")
        before = set(scheduler_workers(client))
        cluster.scale(1)  # as Adaptive retires a worker: Scheduler.retire_workers
        (victim,) = bounded.until(lambda: before - set(scheduler_workers(client)),
                                  "a worker retired")
        placed = cluster.scheduler.plugins[TABLES].maps[job_id]
        assert victim in placed.departed and victim not in placed.workers()
        assert not placed.lost
        Event(go, client=client).set()
        summary = run.result()
        cluster.scale(2)
        client.wait_for_workers(2, timeout=60)  # the next test finds the cluster it expects

    assert summary.rows_lost == 0
    assert summary.rows_trained == TRAIN_ROWS + summary.rows_retrained
    assert summary.auc > 0.55


@pytest.mark.slow
def test_bad_rows_are_quarantined_in_the_ledger_and_the_rest_trained(
        cluster: LocalCluster, cluster_job: Path, small_data: SynthResult,
        tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(small_data.out, copy)
    raw = yaml.safe_load(cluster_job.read_text())
    raw["data"].update(train=[str(copy / "date=2026-11-01"), str(copy / "date=2026-11-02")],
                       validation=str(copy / "date=2026-11-03"), schema=str(copy / "schema.yaml"))
    cluster_job.write_text(yaml.safe_dump(raw))
    bad = sorted(expand(str(copy / "date=2026-11-02")))[1]
    break_label(bad, 2048)
    bad_rows = row_groups([bad])[0].num_rows

    with pytest.raises(DataError) as info:
        bounded.call(train_async, load_job(cluster_job), scheduler=cluster.scheduler_address)
    assert Path(bad).name in str(info.value) and "label" in str(info.value)

    job = load_job(cluster_job, ["data.on_bad_data=quarantine"])
    summary = bounded.call(train_async, job, scheduler=cluster.scheduler_address)
    assert summary.rows_quarantined == bad_rows
    assert summary.rows_trained == TRAIN_ROWS - bad_rows
    assert summary.rows_lost == summary.rows_retrained == 0
    mlflow.set_tracking_uri(job.mlflow.tracking_uri)
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(summary.run_id)}
    assert "quarantine.yaml" in artifacts


@pytest.mark.parametrize("tables", [pytest.param("replicated", marks=pytest.mark.slow),
                                    "sharded"])
def test_a_worker_added_mid_job_joins_and_trains(cluster: LocalCluster, cluster_job: Path,
                                                 tables: str) -> None:
    """The first two workers pause after 1,024 rows each; a third worker joins the running job,
    copies the model (replicated tables) or takes buckets over (sharded: copied to it while the
    others serve them, then handed over) and trains 2,048 rows before they go on."""
    go = f"joiner-trained-{uuid.uuid4().hex}"
    job = load_job(cluster_job, [
        f"model.tables={tables}", "train.epochs=2", "train.shard_rows=512",
        f"faults=[{{worker: 0, pause_after_rows: 1024, pause_until: {go}}}, "
        f"{{worker: 1, pause_after_rows: 1024, pause_until: {go}}}]"])
    run = bounded.start(train_async, job, scheduler=cluster.scheduler_address)
    jobs = cluster.scheduler.plugins[PLUGIN_NAME].jobs
    (job_id,) = bounded.until(lambda: list(jobs), "the job's registration")
    with Client(cluster.scheduler_address) as client:
        bounded.until(lambda: sum(m.get("fault") == "pause" for _, m in
                                  client.get_events(agent.event_topic(job_id))) == 2,
                      "both workers paused")
        before = jobs[job_id].rows_trained
        first = set(cluster.scheduler.workers)
        cluster.scale(3)
        bounded.until(lambda: jobs[job_id].rows_trained >= before + 2048,
                      "the joiner trained 2,048 rows")
        if tables == "sharded":  # the joiner holds buckets, copied to it
            service = cluster.scheduler.plugins[TABLES]
            (joiner,) = service.maps[job_id].workers() - first
            assert sum(map(len, service.maps[job_id].held(joiner))) > 0
            assert service.moves[job_id] > 0
        Event(go, client=client).set()
        summary = run.result()
    cluster.scale(2)

    assert summary.workers == 3
    assert summary.rows_lost == 0
    assert summary.rows_trained == 2 * TRAIN_ROWS + summary.rows_retrained
    mlflow.set_tracking_uri(job.mlflow.tracking_uri)
    metrics = mlflow.get_run(summary.run_id).data.metrics
    assert metrics["agents_joined"] == 1 and metrics["agents_dead"] == 0
    assert metrics["worker2.rows"] >= 2048  # the joiner copied the model and trained


@pytest.mark.slow
def test_a_model_bigger_than_the_workers_memory_limit_is_refused_in_one_line(
        cluster_job: Path, small_data: SynthResult, tmp_path: Path) -> None:
    """Tables of 1 GB on paper (nothing allocates them) against workers limited to 1 GiB: the
    jobs service refuses the job where it is submitted (no job, no agent, no tracking run), and
    ``antdt train`` says so in one line."""
    schema = Schema.from_yaml(Path(small_data.out) / "schema.yaml").to_dict()
    for feature in schema["sparse"]:
        feature["num_embeddings"] = 4_000_000
    big = tmp_path / "big-schema.yaml"
    big.write_text(yaml.safe_dump(schema))
    job = load_job(cluster_job, [f"data.schema={big}", "model.tables=replicated"])
    need = replica_bytes(Schema.from_dict(schema), job.model, job.train.optim)
    assert need > 2 * 10**9  # tables of 8 x 4M x 8 floats, twice, and more
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, memory_limit="1GiB",
                      dashboard_address=":0") as local:
        worker = workers_of(local)[0]
        result = antdt("train", str(cluster_job), "--set", f"data.schema={big}", "--set",
                       "model.tables=replicated", "--scheduler", local.scheduler_address,
                       cwd=tmp_path, check=False)
        with Client(local) as client, JobClient(client, register=False) as jobs:
            records = jobs.status()

    assert result.returncode == 2, result.stderr  # refused, as bad input is
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: the model needs {format_bytes(need)} per worker "
        f"in async mode (every worker holds a full replica), but worker {worker}'s memory "
        f"limit is 1.00 GiB (2 of the job's 2 workers have less than it needs); shard its "
        f"tables over the workers (model.tables: sharded or auto), train it with --mode sync, "
        f"or give the workers more memory")
    assert not records  # no job was made


@pytest.mark.parametrize("args, message", [
    (["--local", "--mode", "async"], "--local contradicts --mode async"),
    (["--workers", "2", "--scheduler", "tcp://127.0.0.1:1"], "give one or the other"),
    (["--mode", "local", "--workers", "2"], "need --mode async"),
])
def test_cli_refuses_contradictory_options(cluster_job: Path, args: list[str],
                                           message: str) -> None:
    result = CliRunner().invoke(cli, ["train", str(cluster_job), *args])
    assert result.exit_code == 2
    assert message in result.output


def housekeeping(client: Client) -> dict[str, list[float]]:
    """Every server's event-loop tick and every memory monitor's interval, in seconds."""
    def tick(dask_scheduler: Any = None, dask_worker: Any = None) -> float:
        server = dask_scheduler if dask_scheduler is not None else dask_worker
        return float(server.periodic_callbacks["tick"].callback_time) / 1000

    def monitor(dask_worker: Any) -> float:
        return float(dask_worker.memory_manager.memory_monitor_interval)

    return {"tick": [client.run_on_scheduler(tick), *client.run(tick).values(),
                     *client.run(tick, nanny=True).values()],
            "memory-monitor": [*client.run(monitor).values(),
                               *client.run(monitor, nanny=True).values()]}


def test_the_local_cluster_takes_its_housekeeping_settings_from_antdt_config() -> None:
    shipped = local_cluster_settings()
    tick = parse_timedelta(shipped["distributed.admin.tick.interval"])
    monitor = parse_timedelta(shipped["distributed.worker.memory.monitor-interval"])
    assert tick > parse_timedelta(dask.config.get("distributed.admin.tick.interval"))
    with connect(1) as client:
        assert housekeeping(client) == {"tick": [tick] * 3, "memory-monitor": [monitor] * 2}
    assert dask.config.get("distributed.admin.tick.interval") != shipped[
        "distributed.admin.tick.interval"]  # the settings only reached the cluster
    with dask.config.set({"antdt.local-cluster": {}}), connect(1) as client:
        dask_default = housekeeping(client)
    assert dask_default == {
        "tick": [parse_timedelta(dask.config.get("distributed.admin.tick.interval"))] * 3,
        "memory-monitor": [parse_timedelta(
            dask.config.get("distributed.worker.memory.monitor-interval"))] * 2}


@pytest.mark.parametrize("settings, message", [
    (["500ms"], "antdt.local-cluster: expected a mapping of Dask settings"),
    ({"admin.tick.interval": "500ms"}, "'admin.tick.interval' is not a Dask setting"),
])
def test_bad_local_cluster_settings_are_refused(settings: object, message: str) -> None:
    with dask.config.set({"antdt.local-cluster": settings}), \
            pytest.raises(ConfigError, match=message):
        local_cluster_settings()
