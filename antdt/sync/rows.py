"""Embedding tables laid end to end (:class:`RowSpace`): the one address space the async
mode's delta entries, snapshots and masks name rows in, however many tables a model has."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from antdt.errors import SyncError
from antdt.sync import kernels


class RowSpace:
    """Embedding tables laid end to end: row ``r`` of table ``name`` is row ``start[name] + r``.

    Every table is ``(num_rows, dim)`` with the same ``dim``, dtype and device. Deltas travel as
    ids of this space, one id array and one delta matrix per log entry however many tables there
    are, so publishing, sending and applying them costs a few tensor operations, not a few per
    table. When the tables are consecutive views of one storage (a ``FusedEmbeddingBagCollection``
    keeps all of its tables in one FBGEMM buffer) :attr:`flat` is a ``(rows, dim)`` view over all
    of them and a gather or an add is one kernel; otherwise the work is split by table.

    >>> storage = torch.zeros(5, 2)
    >>> space = RowSpace({"a": storage[:2], "b": storage[2:]})
    >>> space.start, space.rows, space.flat is not None
    ({'a': 0, 'b': 2}, 5, True)
    >>> RowSpace({"b": storage[2:], "a": storage[:2]}).flat is None  # not in storage order
    True
    """

    def __init__(self, tables: Mapping[str, torch.Tensor]) -> None:
        first = next(iter(tables.values()), torch.zeros(0, 0))
        for name, table in tables.items():
            if table.dim() != 2:
                raise SyncError(f"embedding table {name!r} must be 2-d (num_rows, dim), "
                                f"found shape {tuple(table.shape)}")
            if (table.shape[1], table.dtype, table.device) != (first.shape[1], first.dtype,
                                                               first.device):
                raise SyncError(
                    f"embedding table {name!r} is ({table.shape[1]}, {table.dtype}, "
                    f"{table.device}) in (dim, dtype, device); every table must match the first "
                    f"one's ({first.shape[1]}, {first.dtype}, {first.device})")
        self.tables: dict[str, torch.Tensor] = {name: t.detach() for name, t in tables.items()}
        sizes = [t.shape[0] for t in self.tables.values()]
        self.start = dict(zip(self.tables, itertools.accumulate([0, *sizes[:-1]])))
        self.rows = sum(sizes)
        self.dim, self.dtype, self.device = first.shape[1], first.dtype, first.device
        sized = ";".join(f"{name}:{size}" for name, size in zip(self.tables, sizes))
        self.layout = f"{sized}x{self.dim}"
        """Names and sizes in order: replicas whose ids mean the same rows have equal layouts."""
        self._bounds = torch.tensor(list(itertools.accumulate([0, *sizes])), device=self.device)
        self.flat = _end_to_end(list(self.tables.values()), self.rows)
        """A ``(rows, dim)`` view over every table, or None when they are not end to end."""

    def split(self, space: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per table, its rows of ``space`` (first dimension :attr:`rows`), as views."""
        return {name: space[start:start + table.shape[0]]
                for (name, start), table in zip(self.start.items(), self.tables.values())}

    def concat(self) -> torch.Tensor:
        """A copy of every table, end to end: ``(rows, dim)``."""
        if self.flat is not None:
            return self.flat.clone()
        out = torch.empty(self.rows, self.dim, dtype=self.dtype, device=self.device)
        for name, part in self.split(out).items():
            part.copy_(self.tables[name])
        return out

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (``(k,)`` int64, increasing) of the tables: ``(k, dim)``."""
        if self.flat is not None:
            return self.flat.index_select(0, ids)
        out = torch.empty(len(ids), self.dim, dtype=self.dtype, device=self.device)
        for table, lo, hi, start in self._parts(ids):
            out[lo:hi] = table.index_select(0, ids[lo:hi] - start)
        return out

    def copy_(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Overwrite rows ``ids`` (``(k,)`` int64, increasing) with ``rows`` ``(k, dim)``."""
        self._write(torch.Tensor.index_copy_, ids, rows)

    def add_(self, ids: torch.Tensor, deltas: torch.Tensor) -> None:
        """Add ``deltas`` ``(k, dim)`` to rows ``ids`` (``(k,)`` int64, increasing), in place."""
        self._write(torch.Tensor.index_add_, ids, deltas)

    def _write(self, index_op: Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor], object],
               ids: torch.Tensor, values: torch.Tensor) -> None:
        """``index_op(table, 0, table_ids, table_values)``, an in-place index operation, once
        on :attr:`flat` or per table that ``ids`` reach."""
        if self.flat is not None:
            index_op(self.flat, 0, ids, values)
            return
        for table, lo, hi, start in self._parts(ids):
            index_op(table, 0, ids[lo:hi] - start, values[lo:hi])

    def _parts(self, ids: torch.Tensor) -> Iterator[tuple[torch.Tensor, int, int, int]]:
        """Per table that ``ids`` (increasing) reach: the table, the slice of ``ids`` in it and
        the table's start."""
        cuts = torch.searchsorted(ids, self._bounds).tolist()
        for (table, start), lo, hi in zip(zip(self.tables.values(), self.start.values()),
                                          cuts, cuts[1:]):
            if hi > lo:
                yield table, lo, hi, start


def true_rows(mask: torch.Tensor) -> torch.Tensor:
    """The rows where ``mask`` (``(rows,)`` bool) is true: ``(k,)`` int64, increasing.

    On the CPU through :func:`kernels.true_rows`, one pass over the mask that skips its zero
    words (a round publishes once per period, from masks over every row of the tables).

    >>> true_rows(torch.tensor([False, True, False, True])).tolist()
    [1, 3]
    """
    if mask.device.type == "cpu":
        return torch.from_numpy(kernels.true_rows(mask.numpy()))
    return mask.nonzero().squeeze(1)


def _end_to_end(tables: Sequence[torch.Tensor], rows: int) -> torch.Tensor | None:
    """A ``(rows, dim)`` view over ``tables`` if they are contiguous and follow each other in
    one storage, in this order; else None."""
    if not tables:
        return None
    first = tables[0]
    storage, dim = first.untyped_storage().data_ptr(), first.shape[1]
    offset = first.storage_offset()
    for table in tables:
        if not table.is_contiguous() or table.untyped_storage().data_ptr() != storage \
                or table.storage_offset() != offset:
            return None
        offset += table.shape[0] * dim
    return first.as_strided((rows, dim), (dim, 1))
