"""Where the job pages (:mod:`antdt.watch.pages`) are on the scheduler's web server, for the
clients that print their addresses (``antdt submit``, ``train``, ``status``). Apart from the
pages, which import the job service's names: a client imports this without them."""

from __future__ import annotations

import urllib.parse

JOBS_PATH = "antdt/"
"""The list of jobs, relative to the web server's root (or its prefix)."""


def job_path(job_id: str) -> str:
    """Job ``job_id``'s page, relative to the web server's root (or its prefix)."""
    return f"antdt/jobs/{urllib.parse.quote(job_id, safe='')}"


def page_url(dashboard_link: str, job_id: str | None = None) -> str:
    """The address of job ``job_id``'s page (None: of the list of jobs), from the dashboard's
    address as Dask gives it to clients (``client.dashboard_link``: its ``/status`` page, or
    whatever ``distributed.dashboard.link`` makes of it).

    >>> page_url("http://10.0.0.5:8787/status", "daily-1")
    'http://10.0.0.5:8787/antdt/jobs/daily-1'
    """
    base = dashboard_link.removesuffix("status").rstrip("/") + "/"
    return base + (JOBS_PATH if job_id is None else job_path(job_id))
