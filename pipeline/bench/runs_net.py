"""One benchmark job on a cluster of hosts (:class:`~pipeline.bench.network.NetworkCluster`),
its training data on the network as a production job's Parquet logs are on remote storage.

:func:`run_on_network` starts a new cluster of ``workers`` workers, serves the job's training
files over HTTP from the host's namespace (:mod:`pipeline.bench.http_net`; the job's
``data.train`` becomes their URLs, its validation data and schema stay local files, read at the
end by the evaluation), sets each worker's link to its rate (``tc`` units; None: unlimited),
trains the job and closes the cluster. Every byte a worker reads, every lease and commit and every
sync round with its peers crosses its link.

What it reports besides the job's :class:`~pipeline.bench.jobs.Outcome`, by worker index of the
cluster (worker ``i`` is at :meth:`NetworkCluster.ip` ``i``):

- ``exchanges`` and ``exchanged_bytes``: the model sync's rounds and the tensor bytes the worker
  pulled in them, as its agent's last progress event said (the final round, after it, is not
  counted); ``bytes_per_round`` is their sum over the workers' exchanges;
- ``rows``: the rows its agents trained;
- ``sync_wait_s``: the seconds its training waited for sync rounds (the agent's report);
- ``data_bytes``: the training data's bytes the HTTP server sent it;
- ``link_bytes``: every byte that crossed its link during the job, both ways (the veth's
  counters: data, the scheduler's messages and the sync rounds);
- ``actions``: the controller's actions on it, counted by kind (every one the scheduler logged).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distributed import Client

from antdt.agent import event_topic
from antdt.controller import EVENT_TOPIC as CONTROLLER_TOPIC
from antdt.jobs import JobClient, JobSpec
from pipeline.bench.http_net import FolderServer, served_files
from pipeline.bench.jobs import Outcome
from pipeline.bench.network import NetworkCluster
from pipeline.job.config import JobConfig
from pipeline.training.cluster import job_spec
from pipeline.training.local_cluster import connect, worker_modules
from pipeline.training.following import AgentRecord, outcome

JOIN_S = 120.0
"""The longest a cluster's processes may take to start and join."""


def network_job(job: JobConfig, server: FolderServer) -> JobConfig:
    """``job`` reading its training files over HTTP from ``server``, which serves the folder
    they are in; its validation files and schema as absolute local paths (the cluster's
    processes run in another folder)."""
    data = job.data
    return dataclasses.replace(job, data=dataclasses.replace(
        data, train=tuple(served_files(server, list(data.train))),
        validation=tuple(os.path.abspath(path) for path in data.validation),
        schema=os.path.abspath(data.schema)))


def data_root(job: JobConfig) -> Path:
    """The folder holding every training path of ``job`` (what a server serves)."""
    return Path(os.path.commonpath([os.path.abspath(path) for path in job.data.train]))


class SyncWatch:
    """The last progress event of each of a job's agents (subscribed before the job starts):
    its exchanges and the bytes they pulled."""

    def __init__(self, client: Client, job_id: str) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, tuple[int, int]] = {}
        client.subscribe_topic(event_topic(job_id), self._on_event)

    def _on_event(self, event: tuple[float, dict[str, Any]]) -> None:
        msg = event[1]
        if msg.get("kind") == "progress" and msg.get("exchanged_bytes") is not None:
            with self._lock:
                self._last[str(msg["worker"])] = (int(msg.get("exchanges", 0)),
                                                  int(msg["exchanged_bytes"]))

    def last(self) -> dict[str, tuple[int, int]]:
        """``(exchanges, bytes)`` by worker address, as its last progress event said."""
        with self._lock:
            return dict(self._last)


def controller_actions(client: Client, job_id: str) -> list[dict[str, Any]]:
    """The controller actions applied to ``job_id`` so far, from the scheduler's log of them
    (the Dask events of :data:`~antdt.controller.EVENT_TOPIC`: a job's record shows only the
    last few, and a follower that lags misses those between two of its reads). The log keeps
    the last ``distributed.admin.low-level-log-length`` of every job's."""
    return [dict(msg) for _, msg in client.get_events(CONTROLLER_TOPIC)
            if isinstance(msg, Mapping) and msg.get("job") == job_id]


def actions_of(client: Client, record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every controller action applied to the job of ``record`` (its final record); raises
    where the scheduler's log no longer holds them all."""
    found = controller_actions(client, record["job_id"])
    if len(found) < record["actions_total"]:
        raise RuntimeError(f"job {record['job_id']}: the scheduler's log holds {len(found)} of "
                           f"its {record['actions_total']} controller actions")
    return found


@dataclass(frozen=True)
class NetRun:
    """One job on a cluster of hosts: its outcome and, by worker index, what crossed each
    worker's link (the module's docstring)."""

    outcome: Outcome
    rates: tuple[str | None, ...]
    rows: tuple[int, ...]
    exchanges: tuple[int, ...]
    exchanged_bytes: tuple[int, ...]
    sync_wait_s: tuple[float | None, ...]
    data_bytes: tuple[int, ...]
    link_bytes: tuple[int, ...]
    actions: tuple[dict[str, int], ...]

    @property
    def bytes_per_round(self) -> float | None:
        """Tensor bytes a worker pulled in one round, over every worker's rounds."""
        rounds = sum(self.exchanges)
        return sum(self.exchanged_bytes) / rounds if rounds else None

    def as_dict(self) -> dict[str, Any]:
        """The figures by worker index, and the bytes per round."""
        per_round = self.bytes_per_round
        return {"link_rates": list(self.rates), "rows": list(self.rows),
                "exchanges": list(self.exchanges),
                "exchanged_bytes": list(self.exchanged_bytes),
                "bytes_per_round": None if per_round is None else round(per_round),
                "sync_wait_s": [None if s is None else round(s, 2) for s in self.sync_wait_s],
                "data_bytes": list(self.data_bytes), "link_bytes": list(self.link_bytes),
                "actions": list(self.actions)}


def record_outcome(record: Mapping[str, Any]) -> Outcome:
    """The :class:`Outcome` of a job's final record."""
    return Outcome(outcome(record), [AgentRecord.of(a) for a in record["agents"]],
                   record["first_lease"], record["last_row"], record["stopped"],
                   tuple(w["batch_rows"] for w in record["workers"]))


def _train(client: Client, spec: JobSpec
           ) -> tuple[dict[str, Any], SyncWatch, list[dict[str, Any]]]:
    """Submit ``spec`` and follow it to its end, watching its agents' progress: the final
    record, the watch and the controller's actions on the job."""
    job_id = f"net-{uuid.uuid4().hex[:12]}"
    with JobClient(client) as jobs:
        watch = SyncWatch(client, job_id)
        jobs.submit(spec, job_id=job_id)
        record = jobs.follow(job_id)
    return record, watch, actions_of(client, record)


def _net_run(record: Mapping[str, Any], watch: SyncWatch, actions: Sequence[Mapping[str, Any]],
             workers: Sequence[str], rates: Sequence[str | None], data_bytes: Sequence[int],
             link_bytes: Sequence[int]) -> NetRun:
    last = watch.last()
    agents = {a["worker"]: a for a in record["agents"]}
    trained = Counter[str]()
    for agent in record["agents"]:
        trained[agent["worker"]] += agent["rows"]
    return NetRun(record_outcome(record), tuple(rates), tuple(trained[w] for w in workers),
                  tuple(last.get(w, (0, 0))[0] for w in workers),
                  tuple(last.get(w, (0, 0))[1] for w in workers),
                  tuple(agents.get(w, {}).get("sync_wait_s") for w in workers),
                  tuple(data_bytes), tuple(link_bytes),
                  tuple(dict(Counter(str(a["action"]) for a in actions if a["worker"] == w))
                        for w in workers))


def run_on_network(job: JobConfig, workers: int, rates: Sequence[str | None], *,
                   deadline_s: float | None = None, env: Mapping[str, str] | None = None,
                   folder: Path | None = None) -> NetRun:
    """Train ``job`` on a new cluster of hosts of ``workers`` workers, worker ``i``'s link at
    ``rates[i]`` (the module's docstring); ``env``: what its processes get besides this one's
    environment (e.g. ``DASK_ANTDT__MONITOR__WINDOW``); its logs in ``folder`` (default: a
    temporary one). A job with faults runs on a cluster that allows them."""
    if len(rates) != workers:
        raise ValueError(f"rates: expected one link rate a worker ({workers}), found {rates!r}")
    with tempfile.TemporaryDirectory(prefix="antdt-net-") as scratch, \
            NetworkCluster(folder or Path(scratch), workers, env=env,
                           allow_faults=bool(job.faults), timeout_s=JOIN_S) as net:
        server = net.serve(data_root(job))
        spec = job_spec(network_job(job, server), deadline_s=deadline_s)
        for i, rate in enumerate(rates):
            if rate is not None:
                net.throttle(i, rate)
        before = [net.link_bytes(i) for i in range(workers)]
        with Client(net.address, timeout="30s", set_as_default=False) as client:
            record, watch, actions = _train(client, spec)
        sent = server.sent()
        return _net_run(record, watch, actions, net.workers, rates,
                        [sent.get(net.ip(i), 0) for i in range(workers)],
                        [net.link_bytes(i) - b for i, b in enumerate(before)])


def run_on_loopback(job: JobConfig, workers: int) -> NetRun:
    """Train ``job`` on a new LocalCluster of ``workers`` workers on loopback, as
    :func:`~pipeline.bench.jobs.run_async` does, its data local files: no link, so no link
    rate and no data or link bytes (zeros), its sync rounds watched as on a network."""
    spec = job_spec(job)
    with connect(workers, preload=worker_modules(job)) as client:
        addresses = sorted(client.scheduler_info(n_workers=-1)["workers"])
        record, watch, actions = _train(client, spec)
    return _net_run(record, watch, actions, addresses, [None] * workers, [0] * workers,
                    [0] * workers)
