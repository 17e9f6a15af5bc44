"""The synchronous mode's side on the scheduler: the rendezvous every job's ranks meet in
(:class:`Rendezvous`, one TCP store for the cluster) and the job master's part
(:class:`SyncMaster`: it forms a job's group, and forms it again after a loss)."""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

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

    @property
    def prefix(self) -> str:
        return f"g{self.generation}"


@dataclass
class Rendezvous:
    """On the scheduler: the TCP store every synchronous job's ranks meet in (made on first
    use, on a free port of the scheduler's host) and each job's current :class:`Group`.

    Handler ``antdt_sync_rank(job, worker)``: the worker's rank, the world size, the workers in
    rank order, the store's port, the group's key prefix and its token."""

    groups: dict[str, Group] = field(default_factory=dict)
    _store: dist.TCPStore | None = None
    _generations: dict[str, int] = field(default_factory=dict)

    @property
    def port(self) -> int:
        if self._store is None:
            self._store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        return int(self._store.port)

    def form(self, job: str, workers: Collection[str]) -> Group:
        generation = self._generations.get(job, 0) + 1
        self._generations[job] = generation
        group = self.groups[job] = Group(sorted(workers), generation)
        return group

    def forget(self, job: str) -> None:
        self.groups.pop(job, None)
        self._generations.pop(job, None)

    @rpc.handler
    async def rank(self, job: str, worker: str) -> Reply:
        job = rpc.name("job", job, SyncError)
        worker = rpc.name("worker", worker, SyncError)
        group = self.groups.get(job)
        if group is None:
            raise SyncError(f"job {job!r} has no synchronous group; groups: {sorted(self.groups)}")
        if worker not in group.workers:
            raise SyncError(f"worker {worker} is not in job {job!r}'s group (generation "
                            f"{group.generation}: {group.workers})")
        return {"status": "OK", "rank": group.workers.index(worker),
                "workers": list(group.workers), "port": self.port,
                "prefix": f"antdt/{job}/{group.prefix}", "token": group.token}


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
