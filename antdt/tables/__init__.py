"""Embedding tables sharded over a job's workers, for the async mode (PERSIA's hybrid: tables
trained asynchronously where they live, dense layers synchronised in the background).

Rows belong to buckets; every bucket has a primary and a backup on two workers (chain
replication), placed and moved by the scheduler, served by a worker extension off the event
loop, and pulled and pushed by the trainers with at most ``K`` batches' pushes in flight.

=================================  ============================================================
:mod:`antdt.tables.buckets`        :class:`BucketMap`: which worker holds which bucket (epochs)
:mod:`antdt.tables.optim`          :class:`RowOptimizer`: the sparse optimiser, on the host
:mod:`antdt.tables.store`          :class:`BucketStore`: one worker's buckets, exactly once
:mod:`antdt.tables.serving`        the worker extension: pull, push, forward, copy handlers
:mod:`antdt.tables.service`        the scheduler plugin: placement, failover, moves
:mod:`antdt.tables.client`         :class:`TableClient`: a trainer's pulls and pushes
=================================  ============================================================

This package's namespace holds the plain classes (no Dask cluster needed); import the glue from
its modules.
"""

from antdt.tables.buckets import (BucketMap, Copy, off_host, place, with_worker, without,
                                  without_backups)

__all__ = ["BucketMap", "Copy", "off_host", "place", "with_worker", "without", "without_backups"]
