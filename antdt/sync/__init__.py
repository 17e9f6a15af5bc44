"""Model synchronisation for the async training mode: AntDT-ND with ShadowSync's background sync
and SDPipe's centrally scheduled, decentrally executed groups.

Every worker trains its own replica of the model. A background thread on each worker repeatedly
asks the scheduler for a *group* of peers (the decision is central, the tensors travel worker to
worker) and exchanges with them:

* **Embeddings** keep parameter-server semantics: each worker publishes the deltas of the rows it
  touched to a sequence-numbered log, peers pull and add every entry they have not applied yet.
  Addition commutes, so every replica converges to ``initial + sum of all deltas`` whatever the
  grouping or order (:mod:`antdt.sync.embeddings`).
* **Dense parameters** are averaged in the group as ``x += mean(snapshots) - own snapshot``, so
  progress made during the exchange is kept (:mod:`antdt.sync.dense`).
* **The end**: one final all-member round. Its leader (the member with the smallest address;
  the next one if it leaves) pulls every remaining entry and averages the dense parameters over all; each
  other member then copies from it only the rows either of them changed during the job, and its
  dense parameters. Every other row still holds the initial model's bits on both, so the replicas
  end bit-identical even where floating-point sums were added in different orders, without a
  whole-state copy (:mod:`antdt.sync.replica`).
* **Joiners** adopt a live member's snapshot once every other member has learned of them, then
  pull newer entries as usual.
* **Partitions**: a pull unanswered for ``antdt.sync.pull-timeout`` fails the exchange with that
  peer; the pair is reported and not grouped for a while, and a worker that reaches no other
  member is held at its staleness bound and named partitioned (its rows cannot be synced). A
  request or a payload of a worker that is no member (it left, or was removed while it went on
  training) is refused and counted (:mod:`antdt.sync.reach`, :mod:`antdt.sync.service`).

One module per idea, plain classes first, the Dask glue beside them:

=============================  ==================================================================
:mod:`antdt.sync.rows`         :class:`RowSpace`: the tables end to end, one space of row ids
:mod:`antdt.sync.embeddings`   :class:`LogEntry`, :class:`EmbeddingDeltaLog`
:mod:`antdt.sync.dense`        dense snapshots and group averaging
:mod:`antdt.sync.period`       :class:`SyncPeriod`: how often a worker starts a round;
                               :class:`Staleness`: how far training may run ahead of rounds
:mod:`antdt.sync.replica`      :class:`ReplicaSync`: one worker's side of the protocol
:mod:`antdt.sync.groups`       :class:`SyncScheduler`: who syncs with whom (injected clock)
:mod:`antdt.sync.reach`        :class:`~antdt.sync.reach.Reach`: the pairs that cannot reach
                               each other
:mod:`antdt.sync.wire`         the messages on Dask comms
:mod:`antdt.sync.service`      :class:`~antdt.sync.service.SyncService`, the scheduler plugin
:mod:`antdt.sync.serving`      :class:`~antdt.sync.serving.SyncWorkerPlugin`, serving peers
:mod:`antdt.sync.background`   :class:`~antdt.sync.background.BackgroundSync`, the sync thread
=============================  ==================================================================

This package's namespace holds the plain classes (no Dask cluster needed); import the glue from
its modules. Defaults come from ``antdt.sync`` in dask config.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from antdt.errors import SyncError
from antdt.sync.groups import Answer, FinalStep, MemberState, SyncGroup, SyncScheduler
from antdt.sync.period import DEFAULT_PERIOD, Staleness, SyncPeriod

if TYPE_CHECKING:
    from antdt.sync.dense import average_dense, check_dense, snapshot_dense
    from antdt.sync.embeddings import EmbeddingDeltaLog, LogEntry
    from antdt.sync.rows import RowSpace
    from antdt.sync.replica import (PEER_FAILURES, ExchangeReport, LeaderRows, PeerFetch,
                                    PeerPayload, ReplicaSnapshot, ReplicaSync)

_TENSOR_MODULES = {
    **dict.fromkeys(("average_dense", "check_dense", "snapshot_dense"), "antdt.sync.dense"),
    **dict.fromkeys(("EmbeddingDeltaLog", "LogEntry"), "antdt.sync.embeddings"),
    "RowSpace": "antdt.sync.rows",
    **dict.fromkeys(("PEER_FAILURES", "ExchangeReport", "LeaderRows", "PeerFetch", "PeerPayload",
                     "ReplicaSnapshot", "ReplicaSync"), "antdt.sync.replica"),
}
"""The names whose modules need torch, imported on first use: a job's spec reads
:mod:`antdt.sync.period`, and the job commands that only read or cancel run without torch."""


def __getattr__(name: str) -> Any:
    module = _TENSOR_MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "DEFAULT_PERIOD", "PEER_FAILURES", "Answer", "EmbeddingDeltaLog", "ExchangeReport",
    "FinalStep", "LeaderRows", "LogEntry", "MemberState", "PeerFetch", "PeerPayload",
    "ReplicaSnapshot", "ReplicaSync", "RowSpace", "Staleness", "SyncError", "SyncGroup",
    "SyncPeriod", "SyncScheduler",
    "average_dense", "check_dense", "snapshot_dense",
]
