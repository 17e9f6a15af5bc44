"""A running job's live page in a real browser: Debian's Chromium driven by Selenium through
``/usr/bin/chromedriver`` (no browser download; ``make test-tools`` installs both), a LocalCluster of
two worker processes, a real job over Parquet with TorchRec, worker 1 four times slower.

The screenshot the test takes goes to its temporary folder; with ``ANTDT_WATCH_SCREENSHOT=PATH``
it is copied to ``PATH`` too (``docs/watch-job.png`` was made so)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask.config
import pytest
from distributed import Client, LocalCluster
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from antdt.jobs import JobClient
from pipeline.job.config import load_job
from pipeline.training.cluster import job_spec
from waits import bounded

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"

FAST = {"antdt.sharding.lease-wait": "200ms", "antdt.agent.report-interval": "200ms",
        "antdt.controller.interval": "200ms", "antdt.monitor.window": "500ms"}
"""Progress reports and straggler verdicts within a second or two (tiny data)."""

WORKERS = """return Array.from(document.querySelectorAll("#workers tr[data-worker]"), row =>
    [row.dataset.worker,
     row.querySelector(".classification").textContent.replace(/\s+/g, " ").trim()]);"""
"""The page's workers and their classification, read in one go (the page replaces its content
every refresh: elements found one by one could be gone by the next call)."""

ROWS_DONE = """var done = document.getElementById("rows-done");
return done === null ? null : Number(done.dataset.rows);"""


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    """Headless Chromium as root needs no sandbox and none of its calls home; a profile of its
    own per test."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        pytest.fail(f"the browser test needs Debian's chromium and chromium-driver, missing "
                    f"{missing}: run `make test-tools`", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--window-size=1280,1500",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


EPOCHS = 40
PAUSE_ROWS = EPOCHS * 16_000 * 45 // 100
"""Each worker pauses, holding no lease, for an event nobody sets once it trained 45% of the
job's rows: the job runs until the test cancels it, however fast the machine."""


def test_a_running_job_s_page_shows_its_workers_the_straggler_and_progress(
        browser: webdriver.Chrome, cluster_job: Path, tmp_path: Path) -> None:
    """Worker 1 is 4x slower: the page flags it, and only it, while worker 0 trains (it is
    judged in windows against its peer, so before worker 0 pauses; a paused worker and a
    peerless one keep their verdicts); the rows done grow as the page refreshes itself."""
    gate = f"never-{uuid.uuid4().hex[:8]}"
    job = load_job(cluster_job, [
        f"train.epochs={EPOCHS}", "train.batch_size=256", "train.shard_rows=2048",
        f"faults=[{{worker: 0, pause_after_rows: {PAUSE_ROWS}, pause_until: {gate}}}, "
        f"{{worker: 1, slowdown: 4, pause_after_rows: {PAUSE_ROWS}, pause_until: {gate}}}]"])
    with dask.config.set(FAST), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                         dashboard_address=":0") as cluster, Client(cluster) as client, \
            JobClient(client) as jobs:
        cluster.wait_for_workers(2)
        workers = sorted(client.scheduler_info()["workers"])
        job_id = jobs.submit(job_spec(job))["job"]["job_id"]
        page = jobs.page(job_id)
        assert page is not None
        browser.get(page)
        assert browser.title == f"job {job_id} - antdt"

        slowed = bounded.until(lambda: len(agents := jobs.status(job_id)["agents"]) == 2
                               and agents[1]["worker"], "both agents started")

        def shown() -> Any:
            rows = dict(browser.execute_script(WORKERS))
            flagged = [w for w, kind in rows.items() if kind.startswith("straggler")]
            return sorted(rows) == workers and flagged == [slowed] and rows

        bounded.until(shown, "both workers listed, the slowed one (only) flagged a straggler",
                      timeout_s=180)
        # the page refreshes itself: the rows done it shows grow while the test only reads
        first = bounded.until(lambda: browser.execute_script(ROWS_DONE), "rows done shown")
        bounded.until(lambda: (browser.execute_script(ROWS_DONE) or 0) > first,
                      "the rows done the page shows grow", timeout_s=60)
        assert jobs.status(job_id)["state"] == "running"
        shot = tmp_path / "watch-job.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        if os.environ.get("ANTDT_WATCH_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["ANTDT_WATCH_SCREENSHOT"])

        browser.get(page.removesuffix(f"jobs/{job_id}"))
        assert browser.find_element("css selector", f'tr[data-job="{job_id}"]')
        browser.find_element("link text", "Dask dashboard").click()
        bounded.until(lambda: browser.execute_script(
            "return window.Bokeh !== undefined && Bokeh.documents.length > 0"),
            "the Dask dashboard's /status page renders its Bokeh document", timeout_s=60)
        assert browser.current_url == client.dashboard_link
        browser.find_element("link text", "Antdt").click()  # Dask's navigation bar, back to us
        bounded.until(lambda: browser.find_elements("css selector", f'tr[data-job="{job_id}"]'),
                      "the jobs' page from the dashboard's link", timeout_s=30)

        jobs.cancel(job_id, "the test saw enough")
        assert bounded.call(jobs.follow, job_id)["state"] == "cancelled"
