"""The LocalCluster a command starts (``antdt train``, the benchmarks, the DAG's tasks without a
scheduler), kept apart from :mod:`pipeline.training.cluster` so that starting it imports Dask and
nothing of the training stack: its worker processes import that while this process prepares the
job (:func:`starting`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing.forkserver
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import dask.config
from distributed import Client, LocalCluster
from distributed.security import Security
from distributed.utils import get_mp_context

from antdt import config
from antdt.errors import ConfigError, JobError
from pipeline.job.config import JobConfig
from pipeline.tracking.uris import store_modules

logger = logging.getLogger(__name__)


def worker_modules(job: JobConfig) -> list[str]:
    """What the worker processes of ``job`` import before its agents start: the training stack,
    the tracking code (:mod:`pipeline.tracking.warm` included) and MLflow's modules for the job's
    store (for MLflow's default store, those of both of its defaults: a SQLite file, or
    ``./mlruns`` where one has runs). The master imports the job's exact list again
    (:attr:`antdt.jobs.JobPlan.preload`), which costs nothing when these covered it."""
    uris = [job.mlflow.tracking_uri] if job.mlflow.tracking_uri else ["sqlite://", "file:"]
    return ["pipeline.training.recipes", "pipeline.tracking.tracking", "pipeline.tracking.warm",
            *(module for uri in uris for module in store_modules(uri))]


@contextlib.contextmanager
def connect(workers: int | None = None, scheduler: str | None = None, *,
            security: Security | None = None, preload: Sequence[str] = (),
            memory_limit: str | None = None) -> Iterator[Client]:
    """A client of the scheduler at ``scheduler``, or of a new LocalCluster of ``workers``
    (:func:`starting`, whose worker processes import ``preload`` as they start, each limited to
    ``memory_limit`` by Dask when given), closed at the end."""
    if scheduler is not None:
        with Client(scheduler, security=security, set_as_default=False) as client:
            yield client
        return
    if workers is None:
        raise JobError("connect: give the workers of a LocalCluster to start, or a scheduler")
    with starting(workers, preload, memory_limit) as client:
        yield client()


@contextlib.contextmanager
def starting(workers: int, preload: Sequence[str] = (), memory_limit: str | None = None
             ) -> Iterator[Callable[[], Client]]:
    """A LocalCluster of ``workers`` Nanny-managed worker processes with one thread each (a GPU
    resource each when this machine has CUDA; ``memory_limit`` each when given, else Dask's
    share of this machine's memory), started in a thread at once: its processes
    start while this one prepares the job. Yields a function that waits for the cluster and
    returns a client of it; the cluster is closed at the end (waiting for it to have started).

    With ``antdt.local-cluster``'s ``forkserver`` method (the default) every worker process is
    forked from one server process that imported ``preload`` and Dask once, started here
    first: the stack is imported once, beside this process's own work, not once per worker
    after the cluster started. The cluster's processes log ``distributed`` at this process's
    level (quiet unless ``-v``: :mod:`pipeline.terminal`)."""
    settings = local_cluster_settings()
    level = logging.getLogger("distributed").getEffectiveLevel()
    with dask.config.set(settings):
        if dask.config.get("distributed.worker.multiprocessing-method") == "forkserver":
            _start_forkserver(preload)

    def start() -> LocalCluster:
        with dask.config.set(settings):  # read as the servers start
            return LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                dashboard_address=":0", resources=_gpu_resources(),
                                silence_logs=level, preload=list(preload),
                                memory_limit=memory_limit or "auto")

    clients: list[Client] = []

    def client() -> Client:
        if not clients:
            cluster = future.result()
            clients.append(Client(cluster, set_as_default=False))
            # The cluster's own view of its workers can miss one that registered while it
            # started; a worker that then dies makes the cluster fail on close (KeyError).
            cluster.wait_for_workers(workers)
            logger.info("LocalCluster of %d workers, dashboard %s", workers,
                        clients[0].dashboard_link)
        return clients[0]

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="antdt-cluster") as pool:
        future = pool.submit(start)
        try:
            yield client
        finally:
            for opened in clients:
                opened.close()
            if future.exception() is None:
                future.result().close()


def _gpu_resources() -> dict[str, float] | None:
    """A GPU resource per worker where this machine has CUDA (torch is asked only where an
    NVIDIA driver is installed: a CPU machine's command does not import it)."""
    if not os.path.exists("/dev/nvidiactl"):
        return None
    import torch

    return {"GPU": 1} if torch.cuda.is_available() else None


def _start_forkserver(modules: Sequence[str]) -> None:
    """Start this process's multiprocessing fork server, preloading Dask and ``modules`` (and
    :mod:`pipeline.training.fork_server`: it leaves without tearing its modules down), with
    the environment Dask gives the worker processes it spawns (``distributed.nanny.pre-spawn-
    environ``: one OpenMP thread, malloc trimming), which a forked process inherits from the
    server. A server already running (an earlier cluster of this process) is kept."""
    get_mp_context().set_forkserver_preload(
        ["pipeline.training.fork_server", "distributed", *modules])
    environ = {key: str(value) for key, value in
               dask.config.get("distributed.nanny.pre-spawn-environ").items()}
    saved = {key: os.environ.get(key) for key in environ}
    os.environ.update(environ)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def local_cluster_settings() -> dict[str, Any]:
    """The Dask settings ``antdt.local-cluster`` gives the LocalCluster :func:`connect` starts:
    slower housekeeping than Dask's defaults, which take CPU from training (see antdt.yaml)."""
    settings = config.get("antdt.local-cluster")
    if settings is None:
        return {}
    if not isinstance(settings, Mapping):
        raise ConfigError("dask config antdt.local-cluster: expected a mapping of Dask settings "
                          "like {'distributed.admin.tick.interval': '500ms'}, found "
                          f"{settings!r}")
    for key in settings:
        if not (isinstance(key, str) and key.startswith("distributed.")):
            raise ConfigError(f"dask config antdt.local-cluster: {key!r} is not a Dask setting; "
                              "expected a key like 'distributed.admin.tick.interval'")
    return dict(settings)
