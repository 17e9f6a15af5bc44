"""The daily retraining DAG under a real Airflow 3: parsed by Airflow's DagBag, run with
``airflow dags test`` (``dag.test()``) over tiny synthetic days, with a temporary
``AIRFLOW_HOME`` and MLflow store, a LocalCluster of its own or a long-lived one of the test.

Airflow runs in child processes: importing it reconfigures the whole process's logging."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from distributed import Client, Event
from mlflow import MlflowClient

from antdt.jobs import JobClient
from broken_files import break_label
from data.synth import generate
from pipeline.bench.processes import DaskProcesses
from waits import bounded

ROOT = Path(__file__).resolve().parents[2]
AIRFLOW = str(Path(sys.executable).parent / "airflow")
MODEL = "ranking"
ROW_GROUP_ROWS = 2048
WORSE = ["train.sparse_lr=0.000001", "train.dense_lr=0.0000001"]
"""A configuration that barely learns: its version must not take the champion's place."""


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of an Airflow with a fresh metadata database in a temporary home that
    reads the project's ``dags/``."""
    home = tmp_path_factory.mktemp("airflow-home")
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([AIRFLOW, "db", "migrate"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return env


@pytest.fixture
def days(tmp_path: Path) -> Path:
    """Four days of synthetic data (2026-11-01..04), 12,000 rows a day, and a job over them."""
    generate(str(tmp_path / "data"), rows=48_000, days=4, seed=5, row_group_rows=ROW_GROUP_ROWS,
             files_per_day=2)
    job = {"name": "tiny",
           "data": {"train": "unused", "validation": "unused",
                    "schema": str(tmp_path / "data" / "schema.yaml")},
           "model": {"arch": "dlrm", "embedding_dim": 8, "dense_arch": [16, 8],
                     "over_arch": [16, 1]},
           "train": {"batch_size": 512, "epochs": 1, "seed": 0, "mode": "async", "workers": 2,
                     "min_batches_per_worker": 0, "sync_period": 0.2}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path


@pytest.fixture
def cluster(process_cluster: DaskProcesses) -> str:
    """The long-lived Dask cluster a deployment points the DAG at (the suite's, three worker
    processes; the job file's ``train.workers: 2`` places each job on two of them): its
    scheduler's address."""
    return process_cluster.address


def conf(days: Path, **params: Any) -> dict[str, Any]:
    return {"job_file": str(days / "job.yaml"), "data_root": str(days / "data"),
            "train_days": 1, "tracking_uri": f"sqlite:///{days / 'mlflow.db'}",
            "registered_model": MODEL, **params}


def dags_test(env: dict[str, str], day: str, params: dict[str, Any], cwd: Path
              ) -> subprocess.CompletedProcess[str]:
    """``airflow dags test retrain_ranking DAY`` with ``params``; its output in ``stdout``."""
    return subprocess.run([AIRFLOW, "dags", "test", "retrain_ranking", day, "--conf",
                           json.dumps(params)], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def output(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout + done.stderr


def asset_events(env: dict[str, str]) -> list[dict[str, Any]]:
    """The extras of the events of the DAG's asset, oldest first (Airflow's metadata DB)."""
    with sqlite3.connect(Path(env["AIRFLOW_HOME"]) / "airflow.db") as db:
        rows = db.execute("SELECT e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id "
                          "WHERE a.name = 'antdt_ranking_model' ORDER BY e.id").fetchall()
    return [json.loads(extra) for (extra,) in rows]


def versions(days: Path) -> dict[str, dict[str, str]]:
    """The registered versions of the model, by number, with their tags."""
    client = MlflowClient(f"sqlite:///{days / 'mlflow.db'}")
    return {str(v.version): dict(v.tags) for v in client.search_model_versions(f"name = '{MODEL}'")}


def champion(days: Path) -> str:
    client = MlflowClient(f"sqlite:///{days / 'mlflow.db'}")
    return str(client.get_registered_model(MODEL).aliases["champion"])


def test_the_dag_folder_imports_fast_without_heavy_modules(airflow_env: dict[str, str]) -> None:
    """Airflow's DagBag parses dags/ without an error, and parsing imports nothing but the
    standard library and what Airflow's own parse imports: neither torch, Dask, MLflow nor
    antdt (what makes a parse fast on any machine; its seconds are not the test's verdict)."""
    script = textwrap.dedent(f"""
        import json, sys
        from airflow.dag_processing.dagbag import DagBag
        import airflow.sdk
        before = set(sys.modules)
        bag = DagBag(dag_folder={str(ROOT / 'dags')!r})
        dag = bag.dags["retrain_ranking"]
        dag_module = next(m for m in set(sys.modules) - before
                          if m.endswith("retrain_ranking"))
        print(json.dumps({{
            "errors": {{str(k): str(v) for k, v in bag.import_errors.items()}},
            "dags": sorted(bag.dags),
            "imported": sorted({{m.partition(".")[0] for m in set(sys.modules) - before
                                if m != dag_module}} - set(sys.stdlib_module_names)),
            "heavy": [m for m in ("torch", "dask", "distributed", "mlflow", "pipeline", "antdt")
                      if m in sys.modules],
            "tasks": [t.task_id for t in dag.topological_sort()],
            "params": sorted(dag.params.keys()),
            "catchup": dag.catchup, "max_active_runs": dag.max_active_runs,
        }}))
    """)
    done = subprocess.run([sys.executable, "-c", script], env=airflow_env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, output(done)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["errors"] == {}
    assert found["dags"] == ["retrain_ranking"]
    assert set(found["imported"]) <= {"airflow", "packaging"}  # Airflow's parse's own
    assert found["heavy"] == []
    assert found["tasks"] == ["wait_for_partition", "validate_partition", "train", "promote",
                              "report"]
    assert {"job_file", "data_root", "train_days", "validation_day", "scheduler",
            "tracking_uri", "experiment", "registered_model", "on_bad_data",
            "min_gain"} <= set(found["params"])
    assert found["catchup"] is False and found["max_active_runs"] == 1


@pytest.mark.parametrize("param, variable, expected", [
    ("http://mlflow:5000", "sqlite:////srv/elsewhere.db", "http://mlflow:5000"),
    ("", "sqlite:////srv/elsewhere.db", "sqlite:////srv/elsewhere.db"),
    ("", None, f"sqlite:///{ROOT / 'mlflow.db'}"),
])
def test_the_tracking_store_is_the_param_else_mlflow_s_variable_else_the_project_s(
        airflow_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, param: str,
        variable: str | None, expected: str) -> None:
    """``tracking_store`` in a process like an Airflow worker's, with or without
    MLFLOW_TRACKING_URI: a given param wins; empty, the variable where it is set; else the
    project folder's mlflow.db, what the param's former default resolved to."""
    if variable is None:
        monkeypatch.delitem(airflow_env, "MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setitem(airflow_env, "MLFLOW_TRACKING_URI", variable)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / 'dags')!r})
        from retrain_ranking import tracking_store
        print(tracking_store({param!r}))
    """)
    done = subprocess.run([sys.executable, "-c", script], env=airflow_env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, output(done)
    assert done.stdout.strip().splitlines()[-1] == expected


@pytest.mark.slow
def test_days_register_versions_and_only_a_better_one_takes_the_champion(
        airflow_env: dict[str, str], days: Path, cluster: str) -> None:
    """Day one (on a LocalCluster of its own) registers version 1 and makes it the champion; day
    two, with a configuration that barely learns, trains version 2 on the long-lived cluster
    and keeps the champion; re-running day one trains and registers nothing and reports what
    was decided then. Each run reports in its task log and as an asset event."""
    first = dags_test(airflow_env, "2026-11-02", conf(days), days)
    assert first.returncode == 0, output(first)
    assert set(versions(days)) == {"1"} and champion(days) == "1"
    tags = versions(days)["1"]
    assert tags["antdt.retrain.day"] == "2026-11-02"
    assert json.loads(tags["antdt.data.train"]) == [str(days / "data" / "date=2026-11-01")]
    assert json.loads(tags["antdt.data.validation"]) == [str(days / "data" / "date=2026-11-02")]
    assert "decision   first: the champion is version 1" in output(first)

    second = dags_test(airflow_env, "2026-11-03",  # from scratch: it must not be version 1
                       conf(days, overrides=WORSE, scheduler=cluster, retrain="window"), days)
    assert second.returncode == 0, output(second)
    assert set(versions(days)) == {"1", "2"} and champion(days) == "1"
    assert versions(days)["2"]["antdt.promotion.decision"] == "kept"
    assert "decision   kept: the champion is version 1" in output(second)

    again = dags_test(airflow_env, "2026-11-02", conf(days), days)
    assert again.returncode == 0, output(again)
    assert set(versions(days)) == {"1", "2"} and champion(days) == "1"
    assert "version 1 found (the same job and data, trained before)" in output(again)

    events = asset_events(airflow_env)
    assert [(e["day"], e["version"], e["decision"], e["trained"]) for e in events] == [
        ("2026-11-02", "1", "first", True), ("2026-11-03", "2", "kept", True),
        ("2026-11-02", "1", "first", False)]
    kept = events[1]
    assert kept["champion_version"] == "1" and kept["promoted"] is False
    assert kept["candidate_auc"] < kept["champion_auc"], kept
    assert kept["rows_trained"] == 12_000 and kept["rows_lost"] == 0
    assert kept["validation_rows"] == 12_000


@pytest.mark.slow
def test_the_second_day_continues_the_first_days_champion_over_its_new_day(
        airflow_env: dict[str, str], days: Path, cluster: str) -> None:
    """Two days in a row with the default retrain=incremental and two days of window: the
    first trains its window from scratch (no champion yet), the second continues that
    champion over the one day it has not seen, its run named for both, and is judged as any
    version; re-running either day trains nothing."""
    first = dags_test(airflow_env, "2026-11-03", conf(days, train_days=2, scheduler=cluster),
                      days)
    assert first.returncode == 0, output(first)
    assert "retrain 2026-11-03: window 2026-11-01..2026-11-02 from scratch" in output(first)
    second = dags_test(airflow_env, "2026-11-04", conf(days, train_days=2, scheduler=cluster),
                       days)
    assert second.returncode == 0, output(second)
    assert "retrain 2026-11-04: version 1 + 2026-11-03" in output(second)
    tags = versions(days)["2"]
    assert (tags["antdt.retrain.way"], tags["antdt.retrain.days"]) == (
        "incremental", "2026-11-03")
    assert tags["antdt.rows_trained"] == "12000"  # one day, not the window's two
    assert tags["antdt.promotion.champion_version"] == "1"
    assert set(json.loads(tags["antdt.promotion.guards"])) == {"logloss", "calibration"}
    events = asset_events(airflow_env)
    assert events[-1]["way"] == "incremental" and events[-1]["started_from"] == "1"
    for day in ("2026-11-03", "2026-11-04"):
        again = dags_test(airflow_env, day, conf(days, train_days=2, scheduler=cluster), days)
        assert again.returncode == 0, output(again)
        assert "found (the same job and data, trained before)" in output(again)
    assert set(versions(days)) == {"1", "2"}


def test_an_empty_tracking_uri_tracks_to_the_workers_mlflow_tracking_uri(
        airflow_env: dict[str, str], days: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the tracking_uri param empty and MLFLOW_TRACKING_URI set in the Airflow worker's
    environment, the run, its model version and the champion alias land in that store."""
    store = f"sqlite:///{days / 'deployment.db'}"
    monkeypatch.setitem(airflow_env, "MLFLOW_TRACKING_URI", store)
    done = dags_test(airflow_env, "2026-11-02", conf(days, tracking_uri=""), days)
    assert done.returncode == 0, output(done)
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("antdt-retrain")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert [r.data.tags["antdt.retrain.day"] for r in runs] == ["2026-11-02"]
    assert [str(v.version) for v in client.search_model_versions(f"name = '{MODEL}'")] == ["1"]
    assert str(client.get_registered_model(MODEL).aliases["champion"]) == "1"
    assert not (days / "mlflow.db").exists()


def test_a_corrupt_partition_fails_the_run_at_validation_naming_the_file(
        airflow_env: dict[str, str], days: Path) -> None:
    """A label 2 in the new day's file fails validate_partition, once and without retries,
    naming the file and the column; nothing is trained or registered."""
    broken = sorted((days / "data" / "date=2026-11-04").glob("*.parquet"))[0]
    break_label(str(broken), ROW_GROUP_ROWS)
    done = dags_test(airflow_env, "2026-11-04", conf(days), days)
    text = output(done)
    assert "DagRun Finished" in text and "state=failed" in text
    assert f"{broken} row group 0 column 'label': expected 0/1, found 2 (1 row)" in text
    assert "[DAG TEST] starting task_id=train" not in text
    assert not (days / "mlflow.db").exists() or versions(days) == {}


@pytest.mark.slow
def test_a_retried_train_task_attaches_to_the_job_its_first_try_started(
        airflow_env: dict[str, str], days: Path, cluster: str) -> None:
    """The process running the DAG is killed while its job trains on the long-lived cluster
    (held at its first row by a gate); the retried train task of the same DAG run attaches to
    that job, which is the only one the run ever started, and registers one version."""
    gate = f"gate-{uuid.uuid4().hex[:8]}"
    params = conf(days, scheduler=cluster, overrides=[
        f"faults=[{{worker: 0, pause_until: {gate}}}, {{worker: 1, pause_until: {gate}}}]"])
    log = days / "first.log"
    with log.open("w") as sink:
        first = subprocess.Popen([AIRFLOW, "dags", "test", "retrain_ranking", "2026-11-03",
                                  "--conf", json.dumps(params)], env=airflow_env, cwd=days,
                                 stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    with Client(cluster, set_as_default=False) as client, JobClient(client) as jobs:
        before = {j["job_id"] for j in jobs.status()}

        def started() -> list[dict[str, Any]]:
            assert first.poll() is None, log.read_text()
            return [j for j in jobs.status()
                    if j["job_id"] not in before and j["state"] == "running"]

        job_id = bounded.until(started, "the DAG run's job training", timeout_s=300)[0]["job_id"]
        assert job_id.startswith("retrain_ranking-2026-11-03-")
        os.killpg(first.pid, signal.SIGKILL)
        bounded.call(first.wait)

        runs = subprocess.run([AIRFLOW, "dags", "list-runs", "retrain_ranking", "-o", "json"],
                              env=airflow_env, capture_output=True, text=True, timeout=120)
        run_id = next(r["run_id"] for r in json.loads(runs.stdout)
                      if r["logical_date"].startswith("2026-11-03"))
        retry_log = days / "retry.log"
        with retry_log.open("w") as sink:
            retry = subprocess.Popen([AIRFLOW, "tasks", "test", "retrain_ranking", "train",
                                      run_id], env=airflow_env, cwd=days, stdout=sink,
                                     stderr=subprocess.STDOUT)

        def retried() -> bool:
            """The retry attached, or started a job of its own, or ended."""
            return (f"attached to job {job_id}" in retry_log.read_text()
                    or len({j["job_id"] for j in jobs.status()} - before) > 1
                    or retry.poll() is not None)

        bounded.until(retried, "the retried train task", timeout_s=300)
        Event(gate, client=client).set()
        assert bounded.call(retry.wait, timeout_s=300) == 0, retry_log.read_text()
        ours = [j["job_id"] for j in jobs.status() if j["job_id"] not in before]
    assert f"attached to job {job_id}" in retry_log.read_text()
    assert ours == [job_id]
    assert set(versions(days)) == {"1"}
    client = MlflowClient(f"sqlite:///{days / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("antdt-retrain")
    assert experiment is not None
    assert len(client.search_runs([experiment.experiment_id])) == 1
