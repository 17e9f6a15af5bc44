"""Tracking URIs without MLflow: how one is shown (:func:`redact`) and which of MLflow's modules
reach its store (:func:`store_modules`), for code that must not import MLflow itself (a command
starting its cluster)."""

from __future__ import annotations

import urllib.parse

from antdt.watch import urls


def redact(uri: str) -> str:
    """``uri`` with the password of its user part, if any, shown as ``***`` (for summaries and
    logs; :func:`antdt.watch.urls.redact`, which the framework's records and pages use too).

    >>> redact("http://ann:s3cret@mlflow.example:5000/"), redact("sqlite:///mlflow.db")
    ('http://ann:***@mlflow.example:5000/', 'sqlite:///mlflow.db')
    """
    return urls.redact(uri)


_SQL_SCHEMES = frozenset({"sqlite", "postgresql", "mysql", "mssql"})


def store_modules(tracking_uri: str) -> list[str]:
    """The modules MLflow imports to reach the tracking store at ``tracking_uri``: about a
    second of a core, once per process. A job's workers import them before its agents start,
    so that its metrics task, which runs on a worker beside an agent, does not take that second
    from training (None known for a store of a plugin's scheme).

    >>> store_modules("sqlite:///mlflow.db")[0], store_modules("https://mlflow.example.com")
    ('mlflow.store.tracking.sqlalchemy_store', ['mlflow.store.tracking.rest_store'])
    """
    scheme = urllib.parse.urlsplit(tracking_uri).scheme.partition("+")[0]
    if scheme in _SQL_SCHEMES:
        return ["mlflow.store.tracking.sqlalchemy_store",
                "mlflow.store.tracking.sqlalchemy_workspace_store"]
    if scheme in ("http", "https", "databricks"):
        return ["mlflow.store.tracking.rest_store"]
    if scheme in ("", "file"):
        return ["mlflow.store.tracking.file_store"]
    return []
