"""Fixtures for the pipeline tests: a small synthetic dataset and a job over it."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
import yaml

from data.synth import SynthResult, generate
from pipeline.terminal import OWN_LOGGERS
from waits import bounded


@pytest.fixture(autouse=True)
def process_settings() -> Iterator[None]:
    """The ``antdt`` CLI sets up this process's logging, warnings and environment for a person
    (:func:`pipeline.terminal.configure`); a test that invokes it leaves them as they were, and
    a test that points MLflow's fluent API at its store leaves it unset again."""
    environ = dict(os.environ)
    root = logging.getLogger()
    handlers, levels = list(root.handlers), {name: logging.getLogger(name).level for name in
                                             ("", "distributed", *OWN_LOGGERS)}
    with warnings.catch_warnings():
        yield
    os.environ.clear()
    os.environ.update(environ)
    root.handlers[:] = handlers
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    mlflow.set_tracking_uri(None)  # None: unset, as MLflow resets it itself


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> SynthResult:
    """Three days of synthetic data, small row groups so every path has several."""
    out = tmp_path_factory.mktemp("synthetic")
    return generate(str(out), rows=60_000, days=3, seed=7, row_group_rows=4096, files_per_day=2)


@pytest.fixture
def job_file(tmp_path: Path, tiny_data: SynthResult) -> Path:
    """A job over ``tiny_data`` (two days to train, one to validate) tracked in a temp store."""
    out = Path(tiny_data.out)
    job = {
        "name": "tiny",
        "data": {"train": [str(out / "date=2026-11-01"), str(out / "date=2026-11-02")],
                 "validation": str(out / "date=2026-11-03"),
                 "schema": str(out / "schema.yaml")},
        "model": {"arch": "dlrm", "embedding_dim": 8, "dense_arch": [16, 8],
                  "over_arch": [16, 1]},
        # 78 batches: on every worker the tests start, not on fewer (the small-job default)
        "train": {"batch_size": 512, "epochs": 1, "seed": 0, "log_every": 10,
                  "min_batches_per_worker": 0},
        "mlflow": {"experiment": "tests", "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture(scope="session")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> SynthResult:
    """Three days of 8,000 rows (two files a day, row groups of 2,048 rows), eight sparse
    features: small enough that a cluster job is dominated by its start, not its training."""
    out = tmp_path_factory.mktemp("small")
    return generate(str(out), rows=24_000, days=3, seed=11, row_group_rows=2048,
                    files_per_day=2, num_sparse=8)


@pytest.fixture
def cluster_job(tmp_path: Path, small_data: SynthResult) -> Path:
    """An async job over ``small_data`` (two days to train, one to validate), small model,
    quick sync, tracked in a temp store."""
    out = Path(small_data.out)
    job = {
        "name": "small",
        "data": {"train": [str(out / "date=2026-11-01"), str(out / "date=2026-11-02")],
                 "validation": str(out / "date=2026-11-03"),
                 "schema": str(out / "schema.yaml")},
        "model": {"arch": "dlrm", "embedding_dim": 8, "dense_arch": [16, 8],
                  "over_arch": [16, 1]},
        # 31 batches: on every worker the tests start, not on fewer (the small-job default)
        "train": {"batch_size": 512, "epochs": 1, "seed": 0, "mode": "async", "workers": 2,
                  "min_batches_per_worker": 0, "sync_period": 0.2},
        "mlflow": {"experiment": "tests", "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture(scope="session")
def medium_data(tmp_path_factory: pytest.TempPathFactory) -> SynthResult:
    """Three days of 150,000 rows, eight sparse features: enough for two epochs of async
    training to converge, so two runs' AUCs agree to a few thousandths."""
    out = tmp_path_factory.mktemp("medium")
    return generate(str(out), rows=450_000, days=3, seed=11, row_group_rows=8192,
                    files_per_day=2, num_sparse=8)


@pytest.fixture
def medium_job(cluster_job: Path, medium_data: SynthResult) -> Path:
    """Two epochs of 300,000 rows in batches of 1,024, synced every batch, the default model
    size: fault-free runs' AUCs agree to about 0.005 (the small test model's to 0.03)."""
    out = Path(medium_data.out)
    raw = yaml.safe_load(cluster_job.read_text())
    raw["model"] = {"arch": "dlrm", "embedding_dim": 16}
    raw["data"].update(train=[str(out / "date=2026-11-01"), str(out / "date=2026-11-02")],
                       validation=str(out / "date=2026-11-03"), schema=str(out / "schema.yaml"))
    raw["train"].update(epochs=2, batch_size=1024, shard_rows=4096, sync_period="1 batch")
    cluster_job.write_text(yaml.safe_dump(raw))
    return cluster_job


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """A real ``mlflow server`` on loopback (no auth: it ignores the credentials clients send);
    its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    folder = tmp_path / "mlflow-server"
    folder.mkdir()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}"],
        cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        bounded.until(lambda: _answers(f"{url}/health"), "the MLflow server answers",
                      timeout_s=120)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False
