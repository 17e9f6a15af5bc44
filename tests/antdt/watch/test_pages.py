"""The job pages and their JSON API on a real scheduler's web server: a LocalCluster whose
workers run in this process, real jobs of the trivial model of ``fakes`` (a gate holds a job
running while the test reads it), plain HTTP requests."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask.config
import pytest
from distributed import Client, LocalCluster

from antdt.jobs import JobClient, JobSpec
from antdt.jobs.spec import PLUGIN_NAME
from antdt.watch import pages
from antdt.watch.timeline import timeline_svg
from antdt.watch.urls import page_url
from fakes import GATES, QUICK, TOTAL, job_service, spec
from waits import bounded

@pytest.fixture(scope="module")
def jobs() -> Iterator[JobClient]:
    """Two single-thread workers in this process and the job service (which adds the pages)."""
    with job_service() as job_client:
        yield job_client


def get(url: str) -> tuple[int, str, str]:
    """``(status, content type, body)`` of a GET of ``url`` (an error status too)."""
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


def api(jobs: JobClient, job_id: str) -> dict[str, Any]:
    page = jobs.page(job_id)
    assert page is not None
    status, kind, body = get(page.replace("/antdt/jobs/", "/antdt/api/jobs/"))
    assert (status, kind) == (200, "application/json; charset=UTF-8"), body
    job: dict[str, Any] = json.loads(body)["job"]
    return job


def test_a_running_job_s_page_and_api_show_its_workers_and_progress(jobs: JobClient) -> None:
    gate = f"gate-{uuid.uuid4().hex[:6]}"
    GATES[gate] = threading.Event()
    job_id = jobs.submit(spec(epochs=3, gate=gate))["job"]["job_id"]
    workers = sorted(jobs.client.scheduler_info()["workers"])
    page = jobs.page(job_id)
    listing = jobs.page()
    assert page is not None and listing is not None
    assert page.startswith(jobs.client.dashboard_link.removesuffix("status"))
    assert page.endswith(f"/antdt/jobs/{job_id}") and listing.endswith("/antdt/")

    running = bounded.until(lambda: (job := api(jobs, job_id))["state"] == "running"
                            and len(job["workers"]) == 2 and job["timeline"]["spans"] and job,
                            "both agents started, a lease granted")
    assert sorted(w["worker"] for w in running["workers"]) == workers
    assert running["progress"]["rows_expected"] == 3 * TOTAL and not running["final"]
    assert {w["restarts"] for w in running["workers"]} == {0}
    # the gate holds every read: the leases stay open, their rows the workers' backlog
    assert {s["outcome"] for s in running["timeline"]["spans"]} == {"open"}
    assert sum(w["backlog_rows"] for w in running["workers"]) == \
        sum(s["rows"] == 0 for s in running["timeline"]["spans"]) * 20 > 0  # SHARD_ROWS
    status, kind, html = get(page)
    assert (status, kind) == (200, "text/html; charset=UTF-8")
    assert 'data-final="0"' in html and "<svg" in html and "lease #" in html
    assert all(f'data-worker="{w}"' in html for w in workers)
    status, _, html = get(listing)
    assert status == 200 and f'href="jobs/{job_id}"' in html
    status, _, body = get(listing.replace("/antdt/", "/antdt/api/jobs"))
    assert status == 200 and job_id in [j["job_id"] for j in json.loads(body)["jobs"]]

    GATES[gate].set()
    bounded.call(jobs.follow, job_id)
    done = api(jobs, job_id)
    assert done["final"] and done["state"] == "finished"
    assert done["progress"] == {"rows_done": 3 * TOTAL, "rows_expected": 3 * TOTAL,
                                "fraction": 1.0, "epoch": 3, "epochs": 3}
    spans = done["timeline"]["spans"]
    assert sum(s["rows"] for s in spans) == 3 * TOTAL
    assert "open" not in {s["outcome"] for s in spans}
    assert {s["worker"] for s in spans} <= {w["label"] for w in done["workers"]}
    status, _, html = get(page)
    assert status == 200 and 'data-final="1"' in html and "finished" in html


def test_an_unknown_job_is_a_404_page_and_a_404_json_error(jobs: JobClient) -> None:
    page = jobs.page("no-such-job")
    assert page is not None
    status, kind, html = get(page)
    assert (status, kind) == (404, "text/html; charset=UTF-8")
    assert "No job &#x27;no-such-job&#x27;" in html
    status, kind, body = get(page.replace("/antdt/jobs/", "/antdt/api/jobs/"))
    assert (status, kind) == (404, "application/json; charset=UTF-8")
    assert json.loads(body)["error"].startswith("No job 'no-such-job' on this scheduler")


def test_what_users_name_is_escaped(jobs: JobClient) -> None:
    name = '<script>alert("x")</script>'
    fake = spec()
    job_id = jobs.submit(JobSpec(dataclasses.replace(fake.plan, name=name), fake.code))[
        "job"]["job_id"]
    bounded.call(jobs.follow, job_id)
    page = jobs.page(job_id)
    assert page is not None
    status, _, html = get(page)
    assert status == 200 and "<script>alert" not in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html
    status, _, html = get(page.removesuffix(f"jobs/{job_id}"))
    assert status == 200 and "<script>alert" not in html and "&lt;script&gt;alert" in html


def test_the_timeline_escapes_its_text() -> None:
    svg = timeline_svg(["w<1>"], [{"worker": "w<1>", "lease_id": 3, "start": 0.0, "end": 2.0,
                                   "rows": 10, "outcome": "finished"}],
                       [{"time": 1.0, "worker": "w<1>", "action": "revoke", "rows": None,
                         "reason": "slow & <b>late</b>"}], now=4.0)
    assert "<b>" not in svg and "w&lt;1&gt;" in svg and "slow &amp; &lt;b&gt;late" in svg
    assert svg.count("<rect") == 1 + 0  # one lane (no stripe for the first), one lease
    assert re.search(r'<rect x="150\.0" y="\d+" width="[\d.]+"', svg)


def test_the_pages_say_so_when_the_job_service_is_gone() -> None:
    """Served from Dask's routes setting before any job service, then added by none when the
    service starts (handlers cannot be removed: one set), then answering 503 with a message
    once the service is unregistered."""
    routes = [*dask.config.get("distributed.scheduler.http.routes"), "antdt.watch.pages"]
    with dask.config.set({**QUICK, "distributed.scheduler.http.routes": routes}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                         dashboard_address=":0") as cluster, Client(cluster) as client:
        listing = client.dashboard_link.removesuffix("status") + "antdt/"
        status, _, html = get(listing)
        assert status == 503 and "no antdt job service" in html
        status, _, body = get(listing + "api/jobs")
        assert status == 503 and "no antdt job service" in json.loads(body)["error"]

        with JobClient(client) as jobs:
            assert pages.add_routes(cluster.scheduler) is False  # the setting's are there
            job_id = jobs.submit(spec())["job"]["job_id"]
            bounded.call(jobs.follow, job_id)
            assert get(listing)[0] == 200 and get(listing + f"api/jobs/{job_id}")[0] == 200
            client.unregister_scheduler_plugin(PLUGIN_NAME)

        for url in (listing, f"{listing}jobs/{job_id}"):
            status, kind, html = get(url)
            assert (status, kind) == (503, "text/html; charset=UTF-8") and "unregistered" in html
        status, _, body = get(f"{listing}api/jobs/{job_id}")
        assert status == 503 and "no antdt job service" in json.loads(body)["error"]


@pytest.mark.slow
def test_a_dask_scheduler_with_the_preload_serves_the_pages_before_any_job(
        tmp_path: Path) -> None:
    """``dask scheduler --preload antdt.watch.pages``: ``/antdt/`` answers (that there is no
    job service yet) from the scheduler's start, beside Dask's own pages."""
    file = tmp_path / "scheduler.json"
    scheduler = subprocess.Popen(
        [str(Path(sys.executable).parent / "dask"), "scheduler", "--host", "127.0.0.1",
         "--port", "0", "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(file),
         "--preload", "antdt.watch.pages"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = bounded.until(lambda: _dashboard_port(file), "the scheduler's file",
                             timeout_s=120)
        status, _, html = get(f"http://127.0.0.1:{port}/antdt/")
        assert status == 503 and "no antdt job service" in html
        assert get(f"http://127.0.0.1:{port}/status")[0] == 200
    finally:
        scheduler.terminate()
        scheduler.wait(timeout=60)


def _dashboard_port(file: Path) -> int | None:
    """The dashboard's port from a scheduler's file, once it is written whole."""
    try:
        return int(json.loads(file.read_text())["services"]["dashboard"])
    except (OSError, ValueError, KeyError):
        return None


def test_the_page_address_follows_the_dashboard_link() -> None:
    assert page_url("http://h:8787/status", "a.b-1") == "http://h:8787/antdt/jobs/a.b-1"
    assert page_url("http://h:8787/status") == "http://h:8787/antdt/"
    assert page_url("https://hub/user/me/proxy/8787/status", "j") == \
        "https://hub/user/me/proxy/8787/antdt/jobs/j"


def test_the_run_links_to_an_mlflow_server_only() -> None:
    run = {"run_id": "r1", "experiment_id": "7", "tracking_uri": "http://ann:***@ml:5000/"}
    assert pages.run_link(run) == "http://ml:5000/#/experiments/7/runs/r1"
    assert pages.run_link({**run, "tracking_uri": "sqlite:///mlflow.db"}) is None
    assert pages.run_link(None) is None
