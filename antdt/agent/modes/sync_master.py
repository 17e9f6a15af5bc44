"""The synchronous mode's side on the scheduler: the rendezvous a job's ranks meet in
(:class:`Rendezvous`, one TCP store per job) and the job master's part
(:class:`SyncMaster`: it forms a job's group, and forms it again after a loss).

The store speaks plain TCP and has no authentication (torch's ``TCPStore``; Dask's TLS does not
cover it). So it listens only on the interface the scheduler's Dask comms listen on, one store
per job, and a group's keys live under a random prefix made for each forming: a process that
reaches the port, another job's ranks or a rank of an older forming, cannot guess where the
group's keys are. torch's store binds every interface whatever host it is given, so the socket
is bound here and handed to it."""

from __future__ import annotations

import secrets
import socket
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from distributed.comm import Comm, get_address_host

from antdt import rpc
from antdt.errors import SyncError
from antdt.rpc import Reply

@dataclass
class Group:
    """One forming of a job's group: its workers in rank order, its generation and a token
    unique to it across the cluster's life (a resumed job's generations count from 1 again;
    its final model's parts are written into a folder named by the token)."""

    workers: list[str]
    generation: int
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    secret: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    """The group's key prefix in its job's store: random, told only to the group's ranks (the
    token names a folder on disk, so it is not the secret)."""

    @property
    def prefix(self) -> str:
        return f"antdt/g{self.generation}/{self.secret}"


def listen_on(host: str) -> dist.TCPStore:
    """A store's server listening on ``host`` only, on a free port."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address)
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # the store's server owns the socket from here and closes it when the store goes
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         master_listen_fd=sock.detach())


@dataclass
class Rendezvous:
    """On the scheduler: each synchronous job's current :class:`Group` and the TCP store its
    ranks meet in (made when the first rank asks, on a free port of the interface that rank
    reached the scheduler on: the address Dask listens on; closed when the job is forgotten).

    Handler ``antdt_sync_rank(job, worker, generation=None)``: the worker's rank, the world size,
    the workers in rank order, the store's host and port, the group's key prefix, its token and
    its generation. ``generation``: the forming the caller belongs to (None: the current one, as
    a rank asks while its group forms); a rank whose group broke asks with its own, and when the
    job's group formed again since (the rank was cut off meanwhile: it comes back from a
    partition as a zombie), it is refused, and counted in :attr:`refused`: it can neither rejoin
    its old forming, gone, nor take a place in the new one."""

    groups: dict[str, Group] = field(default_factory=dict)
    stores: dict[str, dist.TCPStore] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    """Per job, the stale calls refused: of a rank of a forming older than the job's current one,
    or of a job forgotten since (a zombie may come back after its job ended: the count is kept
    then, one int for each job that had any)."""
    generations: dict[str, int] = field(default_factory=dict)
    """Per job, its group's latest generation, kept once the job is forgotten (one int per job):
    a job started again under its id (resumed from a checkpoint) goes on from it, so a zombie
    rank of its earlier run can never ask with a generation the new run uses."""

    def store(self, job: str, comm: Comm) -> dist.TCPStore:
        """``job``'s store, made on the host of the scheduler's end of ``comm``."""
        if job not in self.stores:
            host = get_address_host(comm.local_address)
            try:
                self.stores[job] = listen_on(host)
            except OSError as exc:
                raise SyncError(f"job {job!r}: no rendezvous store could listen on the "
                                f"scheduler's address {host}: {exc}") from exc
        return self.stores[job]

    def form(self, job: str, workers: Collection[str]) -> Group:
        generation = self.generations.get(job, 0) + 1
        self.generations[job] = generation
        group = self.groups[job] = Group(sorted(workers), generation)
        return group

    def forget(self, job: str) -> None:
        self.groups.pop(job, None)
        self.stores.pop(job, None)  # its server stops, its port closes

    @rpc.handler
    async def rank(self, comm: Comm, job: str, worker: str, generation: object = None) -> Reply:
        job = rpc.name("job", job, SyncError)
        worker = rpc.name("worker", worker, SyncError)
        asked = rpc.integer("generation", generation, 1, optional=True, error=SyncError)
        group = self.groups.get(job)
        if asked is not None and (group is None or asked != group.generation):
            self.refused[job] = self.refused.get(job, 0) + 1
            now = "is over" if group is None else \
                f"formed again since (generation {group.generation}: {group.workers})"
            raise SyncError(f"stale: worker {worker} asks as a rank of generation {asked} of job "
                            f"{job!r}, whose group {now}")
        if group is None:
            raise SyncError(f"job {job!r} has no synchronous group; groups: {sorted(self.groups)}")
        if worker not in group.workers:
            raise SyncError(f"worker {worker} is not in job {job!r}'s group (generation "
                            f"{group.generation}: {group.workers})")
        store = self.store(job, comm)
        return {"status": "OK", "rank": group.workers.index(worker),
                "workers": list(group.workers), "host": store.host, "port": int(store.port),
                "prefix": group.prefix, "token": group.token, "generation": group.generation}


class SyncMaster:
    """:class:`~antdt.agent.modes.MasterMode` of the synchronous mode: forms the job's group at
    its start and anew after a restart; a worker that arrives later waits for the next forming
    (a group of fixed ranks cannot take a joiner between two steps)."""

    regroups = True
    tables_inflight: int | None = None

    def tables(self, job: str) -> dict[str, Any] | None:
        return None

    def __init__(self, rendezvous: Rendezvous) -> None:
        self.rendezvous = rendezvous

    def start(self, job: str, workers: Collection[str]) -> None:
        self.rendezvous.form(job, workers)

    def restart(self, job: str, workers: Collection[str]) -> None:
        self.rendezvous.form(job, workers)

    def accepts_joiners(self, job: str) -> bool:
        return False

    def partitioned(self, job: str) -> dict[str, str]:
        return {}  # a rank cut from its peers breaks the step: the job regroups

    def stale_refused(self, job: str) -> int:
        """The stale calls of ``job``'s ranks refused so far (:attr:`Rendezvous.refused`)."""
        return self.rendezvous.refused.get(job, 0)
