"""Passwords in the URLs a job carries (data, checkpoints, tracking store, registry) are shown
redacted everywhere a job is shown: the MLflow run's params, tags and ``job.yaml``, the job's log,
its page and JSON. Each sink with the strings a job carries, and one real job whose checkpoints
go to a URL with a password (an in-memory store: it takes any name) end to end."""

from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path

import dask.config
import mlflow
import pytest

from antdt.jobs import JobClient
from antdt.jobs.journal import Journal
from antdt.watch.urls import redact, redact_all
from pipeline.job.config import load_job
from pipeline.tracking.tracking import Tracker, flatten, public_config
from pipeline.training.cluster import job_spec
from pipeline.training.local_cluster import connect, worker_modules
from waits import bounded

SECRET = "s3cr3t-Pa55"


def test_every_url_in_a_text_loses_its_password_and_nothing_else() -> None:
    text = (f"read s3://AKIA:{SECRET}@bucket/day=1 and postgresql://u:{SECRET}@db:5432/x; "
            f"http://mlflow:5000/ git@github.com:a/b memory://u:p@w:{SECRET}@ck/dir")
    shown = redact(text)
    assert SECRET not in shown
    assert shown == ("read s3://AKIA:***@bucket/day=1 and postgresql://u:***@db:5432/x; "
                     "http://mlflow:5000/ git@github.com:a/b memory://u:***@ck/dir")
    assert redact_all({"a": [f"s3://u:{SECRET}@b", (1, f"x://:{SECRET}@h")], "n": 3}) == \
        {"a": ["s3://u:***@b", (1, "x://:***@h")], "n": 3}


def test_a_job_config_shown_to_mlflow_has_no_password(job_file: Path, tmp_path: Path) -> None:
    job = load_job(job_file, [f"train.checkpoint_dir=memory://ann:{SECRET}@ck/x",
                              f"mlflow.tracking_uri=http://ann:{SECRET}@mlflow:5000"])
    assert SECRET in json.dumps(job.to_dict())  # the job itself uses the real URL
    shown = public_config(job)
    assert SECRET not in json.dumps(shown)
    assert flatten(shown)["train.checkpoint_dir"] == "memory://ann:***@ck/x"


def test_the_job_log_and_run_tags_show_urls_redacted(tmp_path: Path) -> None:
    journal = Journal("j", lambda: 1.0, lambda: None, log_length=10)
    journal.log("error", f"cannot write memory://u:{SECRET}@ck/x: denied")
    assert [r["message"] for r in journal.logs] == ["cannot write memory://u:***@ck/x: denied"]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.create_experiment("secrets"))
    tracker = Tracker(uri, run.info.run_id, run.info.experiment_id)
    tracker.tag("antdt.model_dir", f"s3://u:{SECRET}@models/m")
    tracker.end("FAILED", f"OSError: s3://u:{SECRET}@models/m unreachable")
    tags = client.get_run(run.info.run_id).data.tags
    assert tags["antdt.model_dir"] == "s3://u:***@models/m"
    assert tags["antdt.error"] == "OSError: s3://u:***@models/m unreachable"


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as answer:
        return str(answer.read().decode())


@pytest.mark.slow
def test_a_real_jobs_run_log_page_and_json_never_show_its_checkpoint_password(
        cluster_job: Path, tmp_path: Path) -> None:
    folder = f"memory://ann:{SECRET}@checkpoints/{uuid.uuid4().hex[:8]}"
    job = load_job(cluster_job, [f"train.checkpoint_dir={folder}",
                                 "train.checkpoint_every=1", "train.epochs=4"])
    # a checkpoint at every tick that saw rows trained: several before the end
    with dask.config.set({"antdt.jobs.tick": "100ms"}), \
            connect(2, preload=worker_modules(job)) as client, JobClient(client) as jobs:
        job_id = jobs.submit(job_spec(job))["job"]["job_id"]
        record = bounded.call(jobs.follow, job_id)
        page = jobs.page(job_id)
        assert page is not None
        html = get(page)
        api = get(page.replace("/antdt/jobs/", "/antdt/api/jobs/"))
        listing = get(page.replace(f"/antdt/jobs/{job_id}", "/antdt/api/jobs"))
        log = json.dumps(jobs.logs(job_id))
    assert record["state"] == "finished", record["error"]
    assert record["checkpoints"]["written"] >= 1, log  # the job did use the URL with its password
    assert "ann:***@checkpoints" in api
    assert "ann:***@checkpoints" in record["checkpoint"]  # what antdt status shows
    for shown in (html, api, listing, log, json.dumps(record, default=str)):
        assert SECRET not in shown
    mlflow.set_tracking_uri(job.mlflow.tracking_uri)
    run = mlflow.get_run(record["run"]["run_id"])
    assert run.data.params["train.checkpoint_dir"] == folder.replace(SECRET, "***")
    assert SECRET not in json.dumps(run.data.params) + json.dumps(run.data.tags)
    text = mlflow.artifacts.load_text(f"{run.info.artifact_uri}/job.yaml")
    assert SECRET not in text and "ann:***@checkpoints" in text
