"""Stateful dynamic data sharding (AntDT's SDDS): the shard ledger of each job, the scheduler
plugin that serves it, and the worker-side client an agent leases and commits through.

=================================  ==============================================================
:mod:`antdt.sharding.ledger`       :class:`ShardLedger`: one job's shards, leases, claims and
                                   row counters (a plain class with an injected clock)
:mod:`antdt.sharding.dealing`      the job's shards and how the ledger deals them: one shared
                                   queue, or the static baseline's fixed slots; a global batch's
                                   split among ranks (:func:`shares`)
:mod:`antdt.sharding.leases`       what the ledger hands out and reports (plain values)
:mod:`antdt.sharding.checkpoint`   what a ledger checkpoint holds and its byte format
:mod:`antdt.sharding.service`      :class:`~antdt.sharding.service.ShardingService`, the
                                   scheduler plugin with the ``antdt_*`` handlers
:mod:`antdt.sharding.client`       :class:`~antdt.sharding.client.ShardClient`, the worker side
=================================  ==============================================================

This package's namespace holds the plain ledger and its values; import the Dask glue from its
modules.
"""

from __future__ import annotations

from antdt.sharding.checkpoint import LedgerState
from antdt.sharding.dealing import shares
from antdt.sharding.leases import (Claim, Clock, CommitEvent, CommitReply, Finished, JobState,
                                   Lease, LeaseReply, LeaseStatus, Piece, QuarantineRecord,
                                   QuarantineSpec, Revoked, RowGroup, RowState, Stop, Wait)
from antdt.sharding.ledger import ShardLedger

__all__ = [
    "Claim", "Clock", "CommitEvent", "CommitReply", "Finished", "JobState", "Lease",
    "LeaseReply", "LeaseStatus", "LedgerState", "Piece", "QuarantineRecord", "QuarantineSpec",
    "Revoked", "RowGroup", "RowState", "ShardLedger", "Stop", "Wait", "shares",
]
