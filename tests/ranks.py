"""A gloo group of spawned processes for tests of collective code (``from ranks import Ranks``).

Starting a rank costs seconds of imports (torch, torchrec), so a :class:`Ranks` pool starts its
processes once and runs many functions on them. A function runs on every rank as
``fn(group, *args)`` and must be a module-level function of an importable module (the
processes are spawned, so they import it by name). :class:`Group` hands it the default group
and subgroups of the first ``n`` ranks, so one pool of 3 serves 1-, 2- and 3-rank tests::

    with Ranks(3) as ranks:
        results = ranks.run(fn, batch)   # [rank 0's value, rank 1's, rank 2's]

Every wait is bounded: a rank that raises fails the run with its traceback; ranks that do not
answer in time (a collective left waiting) are killed and the run fails.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

START_TIMEOUT_S = 180.0
"""Spawned ranks import torch and torchrec: tens of seconds on 2 busy cores."""

RUN_TIMEOUT_S = 120.0
COLLECTIVE_TIMEOUT = timedelta(seconds=90)
"""The process group's own limit: a rank left in a collective fails instead of hanging."""


@dataclass
class Group:
    """What a rank knows: its rank in the pool and the groups it belongs to."""

    rank: int
    world_size: int
    subgroups: dict[int, dist.ProcessGroup | None]

    def first(self, n: int) -> dist.ProcessGroup | None:
        """The group of ranks ``0 .. n-1`` (the default group for the whole pool); None on the
        ranks outside it."""
        return self.subgroups[n]


def _serve(rank: int, world_size: int, store: str, inbox: Any, outbox: Any) -> None:
    """One rank: join the group, then run what arrives in ``inbox`` until ``None``."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    subgroups: dict[int, dist.ProcessGroup | None] = {world_size: dist.group.WORLD}
    for n in range(1, world_size):
        group = dist.new_group(list(range(n)))  # collective: every rank creates every subgroup
        subgroups[n] = group if rank < n else None
    outbox.put((rank, "ready", None))
    context = Group(rank, world_size, subgroups)
    while (message := inbox.get()) is not None:
        fn, args = pickle.loads(message)
        try:
            outbox.put((rank, "value", pickle.dumps(fn(context, *args))))
        except BaseException:  # handed to the test process, which fails the run with it
            outbox.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class Ranks:
    """``world_size`` spawned processes in one gloo group (a file store, so no port to pick)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._dir = tempfile.TemporaryDirectory(prefix="ranks-")
        context = multiprocessing.get_context("spawn")
        self._outbox = context.Queue()
        self._inboxes = [context.Queue() for _ in range(world_size)]
        store = Path(self._dir.name) / "store"
        self._processes = [
            context.Process(target=_serve, name=f"rank-{rank}", daemon=True,
                            args=(rank, world_size, str(store), self._inboxes[rank],
                                  self._outbox))
            for rank in range(world_size)]
        for process in self._processes:
            process.start()
        self._collect("ready", START_TIMEOUT_S)

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        """One answer from every rank, in rank order; on a rank's error or a timeout the pool is
        closed and the test fails."""
        answers: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(answers) < self.world_size:
                rank, kind, value = self._outbox.get(
                    timeout=max(0.0, deadline - time.monotonic()))
                answers[rank] = (kind, value)
        except queue.Empty:
            self.close()
            pytest.fail(f"{what}: ranks {sorted(set(range(self.world_size)) - set(answers))} "
                        f"did not answer within {timeout_s:g}s", pytrace=False)
        errors = [f"rank {rank}:\n{value}" for rank, (kind, value) in sorted(answers.items())
                  if kind == "error"]
        if errors:
            pytest.fail(f"{what} raised\n" + "\n".join(errors), pytrace=False)
        return [answers[rank][1] for rank in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any,
            timeout_s: float = RUN_TIMEOUT_S) -> list[Any]:
        """``fn(group, *args)`` on every rank; the values in rank order."""
        if not all(process.is_alive() for process in self._processes):
            pytest.fail("the pool of ranks is closed (an earlier run failed)", pytrace=False)
        message = pickle.dumps((fn, args))
        for inbox in self._inboxes:
            inbox.put(message)
        return [pickle.loads(value)
                for value in self._collect(getattr(fn, "__name__", repr(fn)), timeout_s)]

    def close(self) -> None:
        """Stop the ranks: politely when they are idle, by force after a bound."""
        for process, inbox in zip(self._processes, self._inboxes):
            if process.is_alive():
                inbox.put(None)
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
        self._dir.cleanup()
