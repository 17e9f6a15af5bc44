"""Where the job pages (:mod:`antdt.watch.pages`) are on the scheduler's web server, for the
clients that print their addresses (``antdt submit``, ``train``, ``status``), and how every URL
a job carries is shown (:func:`redact`: its password never). Apart from the pages, which import
the job service's names: a client imports this without them."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

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


_USER_INFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^\s/?#:@]*):"
                        r"(?P<password>[^\s/?#]*)@")
"""``scheme://user:password@`` in a text (the password may hold ``@``: the last one before the
host counts, as in a URL's authority)."""


def redact(text: str) -> str:
    """``text`` with the password of every URL in it shown as ``***``: a URL a job carries
    (its data, checkpoints, tracking store, registry) as params, tags, records, pages, JSON,
    logs and error texts show it. Only what is shown: the workers use the URL itself.

    >>> redact("s3://ann:s3cr@t@bucket/day=1 failed; see http://mlflow:5000/ and sqlite:///a.db")
    's3://ann:***@bucket/day=1 failed; see http://mlflow:5000/ and sqlite:///a.db'
    """
    if "@" not in text:
        return text
    return _USER_INFO.sub(r"\g<head>\g<user>:***@", text)


def redact_all(value: Any) -> Any:
    """``value`` (plain data: mappings, lists, tuples, strings, numbers) with :func:`redact`
    applied to every string in it, keys included; a new copy wherever something changed.

    >>> redact_all({"checkpoint_dir": "memory://u:pw@x/ck", "epochs": 2, "data": ["a", "b"]})
    {'checkpoint_dir': 'memory://u:***@x/ck', 'epochs': 2, 'data': ['a', 'b']}
    """
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {redact_all(k): redact_all(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(redact_all(v) for v in value)
    if isinstance(value, list):
        return [redact_all(v) for v in value]
    return value
