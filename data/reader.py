"""Reading a row range of a Parquet row group into a TorchRec ``Batch``.

A shard is a row range of one row group, trained one batch at a time, so :class:`ShardReader`
decodes a row group once (pyarrow), converts all of it (dense transform, hashing, label cast:
numpy, vectorised per column, never a Python loop per row), keeps the result in a small LRU, and
cuts batches out of it with slices.

Batch layout, for a batch of ``B`` rows, ``D = len(schema.dense)`` and ``F = len(schema.sparse)``:

- ``dense_features``: float32 ``(B, D)``, columns in ``schema.dense`` order, each value
  ``log1p(max(x, 0))``. A null (or NaN) becomes 0, the same as a raw 0, so "missing" and "zero
  count" look alike to the model, as in the usual Criteo preprocessing; negative values are
  clipped to 0 for the same reason (counts).
- ``labels``: float32 ``(B,)``, the label column as 0.0/1.0.
- ``sparse_features``: a ``KeyedJaggedTensor`` with ``keys = schema.sparse_names`` (schema
  order), int64 ``values`` (embedding buckets, see :mod:`data.hashing`) and int32 ``lengths`` of
  shape ``(F * B,)``, key-major (all ``B`` rows of key 0, then all of key 1, ...):

  * a single-valued column gives exactly one bucket per row; a null gives bucket 0;
  * a multi-valued (list) column gives the buckets of the list's elements (a null element:
    bucket 0); a null or empty list gives one bucket 0, so every bag is non-empty and
    "no value" is a learnable feature rather than an all-zero pooled embedding.

Example, ``B = 3`` rows, dense ``[I1, I2]``, sparse ``[C1 (int), T (multi-valued)]``::

    row   label   I1     I2     C1     T
    0     1       0      null   42     [7, 9]
    1     0       e-1    3      null   []
    2     0       -5     1      42     null

    dense_features  = [[0.0, 0.0],          # log1p(0), null -> 0
                       [1.0, 1.386],        # log1p(e - 1) = 1, log1p(3)
                       [0.0, 0.693]]        # max(-5, 0) = 0, log1p(1)
    labels          = [1.0, 0.0, 0.0]

    #          row:  0        1     2
    # "C1"         [h(42)]   [0]   [h(42)]
    # "T"          [h(7),h(9)] [0] [0]
    keys    = ["C1", "T"]
    values  = [h(42), 0, h(42),  h(7), h(9), 0, 0]     # h(x) in [1, num_embeddings)
    lengths = [1, 1, 1,          2, 1, 1]

A file whose columns do not match the schema raises :class:`~antdt.errors.DataError` naming the
file, row group, column, the expected and the found type. :func:`table_batch` turns an in-memory
Arrow table into one ``Batch`` with the same code (scoring raw rows at serving time).

A reader is not thread-safe: use one per thread (its cache is per reader).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from antdt.errors import DataError
from data.files import open_parquet
from data.hashing import hash_arrow, int64_values, zero_nulls
from data.schema import NULL_BUCKET, Schema, SparseFeature
from data.validate import file_schema_problems

logger = logging.getLogger(__name__)


_LOG1P_TABLE_SIZE = 1 << 14
_LOG1P_TABLE = np.log1p(np.arange(_LOG1P_TABLE_SIZE, dtype=np.float64)).astype(np.float32)

Job = Callable[[], None]


@dataclass(frozen=True)
class _MultiValued:
    """One multi-valued column of a decoded row group: row ``i`` owns
    ``values[offsets[i]:offsets[i + 1]]`` (at least one bucket per row)."""

    values: npt.NDArray[np.int64]
    offsets: npt.NDArray[np.int64]


@dataclass(frozen=True)
class _Decoded:
    """A whole row group, converted; batches are copies of slices of it (never views, so a
    reader may overwrite the arrays once it evicts the row group).

    ``dense`` is ``(D, N)`` (column-major, so each column converts in one contiguous pass),
    ``single`` is ``(S, N)`` buckets of the ``S`` single-valued sparse columns (schema order),
    ``labels`` ``(N,)``, ``multi`` the multi-valued columns by name.
    """

    num_rows: int
    dense: npt.NDArray[np.float32]
    labels: npt.NDArray[np.float32]
    single: npt.NDArray[np.int64]
    multi: dict[str, _MultiValued]


def dense_transform(columns: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``log1p(max(x, 0))`` in place, NaN (a null) -> 0; returns ``columns``.

    Computed as ``log(fmax(x + 1, 1))``: numpy's float32 ``log`` is vectorised (AVX2) where its
    ``log1p`` is not (3x slower), and the lost precision of ``1 + x`` for ``x < 1e-7`` does not
    matter for counts; ``fmax`` maps NaN to 1, so nulls come out as 0.
    """
    columns += 1.0
    np.fmax(columns, 1.0, out=columns)
    np.log(columns, out=columns)
    return columns


def dense_column(array: pa.Array, out: npt.NDArray[np.float32]) -> None:
    """The transformed values (:func:`dense_transform`) of one dense Arrow array into ``out``.

    Integer counts, the usual case, are looked up in a table of ``log1p(0 .. 16383)`` (a gather
    is cheaper than a float ``log``); the few counts outside the table, negative or larger, are
    computed. The gather wraps (``mode="wrap"``, 1.6x faster than ``"clip"``), so those counts
    get a wrong value first and are then overwritten.
    """
    if not pa.types.is_integer(array.type):
        out[:] = array.to_numpy(zero_copy_only=False)
        dense_transform(out)
        return
    counts = int64_values(array)
    np.take(_LOG1P_TABLE, counts, out=out, mode="wrap")
    # As unsigned integers, negative counts are huge: one comparison finds both kinds.
    outside = np.flatnonzero(counts.view(np.uint64) >= _LOG1P_TABLE_SIZE)
    if len(outside):
        out[outside] = np.log1p(np.maximum(counts[outside], 0).astype(np.float64))
    zero_nulls(out, array)


def multi_valued_buckets(lists: pa.Array, feature: SparseFeature) -> _MultiValued:
    """Buckets of a list column: each row's elements, or one bucket 0 for a null/empty list."""
    flat = hash_arrow(pc.list_flatten(lists), feature.num_embeddings)
    lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy().astype(np.int64)
    bag_sizes = np.maximum(lengths, 1)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(bag_sizes, out=offsets[1:])
    values = np.full(int(offsets[-1]), NULL_BUCKET, dtype=np.int64)
    # Element k of row r goes to offsets[r] + k: row starts repeated per element, plus the
    # element's rank within its row.
    flat_starts = np.cumsum(lengths) - lengths
    rank_in_row = np.arange(len(flat), dtype=np.int64) - np.repeat(flat_starts, lengths)
    values[np.repeat(offsets[:-1], lengths) + rank_in_row] = flat
    return _MultiValued(values=values, offsets=offsets)


def _chunk_wise(column: pa.ChunkedArray, out: npt.NDArray[Any],
                convert: Callable[[pa.Array, npt.NDArray[Any]], None]) -> None:
    """``convert`` each chunk of ``column`` into its slice of ``out`` (no concatenation)."""
    start = 0
    for chunk in column.chunks:
        convert(chunk, out[start:start + len(chunk)])
        start += len(chunk)


def _hash_into(array: pa.Array, out: npt.NDArray[np.int64], num_embeddings: int) -> None:
    hash_arrow(array, num_embeddings, out=out)


def _dense_rows(columns: int, rows: int) -> npt.NDArray[np.float32]:
    """An empty float32 ``(columns, rows)`` array whose rows start 64 bytes past a multiple of
    4 KiB from each other.

    ``_batch`` copies it transposed, reading one value of every row at a time; rows a multiple
    of 4 KiB apart (65,536 rows: 256 KiB) map to the same L1 cache set and evict each other,
    which makes that copy 1.7x slower.
    """
    stride = -(-rows // 1024) * 1024 + 16
    return np.empty((columns, stride), dtype=np.float32)[:, :rows]


class _Converter:
    """Converts the columns of one row group, one job per column.

    Each job writes its own row of ``dense``/``single`` (or its own ``multi`` entry), so jobs
    may run in any order and in parallel: numpy releases the GIL while it computes.

    ``spare``, a row group evicted from a reader's cache, lends its arrays when it has as many
    rows: a fresh 17 MB of arrays per 65,536-row group costs thousands of page faults (the
    kernel zeroes every new page), up to 10% of the reader's time.
    """

    def __init__(self, schema: Schema, rows: int, where: str,
                 spare: _Decoded | None = None) -> None:
        self.schema = schema
        self.where = where
        self.rows = rows
        self.single_features = [f for f in schema.sparse if not f.multi_valued]
        self.multi: dict[str, _MultiValued] = {}
        if spare is not None and spare.num_rows == rows:
            self.labels, self.dense, self.single = spare.labels, spare.dense, spare.single
            return
        self.labels = np.empty(rows, dtype=np.float32)
        self.dense = _dense_rows(len(schema.dense), rows)
        self.single = np.empty((len(self.single_features), rows), dtype=np.int64)

    def jobs(self, table: pa.Table) -> list[Job]:
        """The conversion jobs of ``table``'s schema columns (types already checked)."""
        schema = self.schema
        jobs: list[Job] = [functools.partial(self._labels, table.column(schema.label))]
        jobs += [functools.partial(_chunk_wise, table.column(name), self.dense[i], dense_column)
                 for i, name in enumerate(schema.dense)]
        jobs += [functools.partial(_chunk_wise, table.column(f.name), self.single[i],
                                   functools.partial(_hash_into, num_embeddings=f.num_embeddings))
                 for i, f in enumerate(self.single_features)]
        jobs += [functools.partial(self._multi, table.column(f.name), f)
                 for f in schema.sparse if f.multi_valued]
        return jobs

    def _labels(self, column: pa.ChunkedArray) -> None:
        if column.null_count:
            raise DataError(f"{self.where} column {self.schema.label!r}: expected 0/1 labels, "
                            f"found {column.null_count} null(s)")
        self.labels[:] = column.to_numpy()

    def _multi(self, column: pa.ChunkedArray, feature: SparseFeature) -> None:
        self.multi[feature.name] = multi_valued_buckets(column.combine_chunks(), feature)

    def result(self) -> _Decoded:
        return _Decoded(num_rows=self.rows, dense=self.dense, labels=self.labels,
                        single=self.single, multi=self.multi)


class ShardReader:
    """Turns ``(file, row group, row range)`` into ``Batch``es (layout: module docstring).

    Keeps the last ``cache_row_groups`` decoded row groups, so consecutive batches of one row
    group decode it once, and converts the next one into the arrays of the one it evicts. Columns are converted by ``threads`` threads (default: pyarrow's CPU
    count, the threads pyarrow decodes with); ``threads=1`` converts in the calling thread.
    """

    def __init__(self, schema: Schema, *, cache_row_groups: int = 2,
                 threads: int | None = None) -> None:
        if cache_row_groups < 1:
            raise ValueError(f"cache_row_groups must be >= 1, found {cache_row_groups}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, found {threads}")
        self.schema = schema
        self.cache_row_groups = cache_row_groups
        self.threads = threads if threads is not None else pa.cpu_count()
        self.decoded_row_groups = 0
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple[str, int], _Decoded] = OrderedDict()
        # The last file read, open, its footer parsed and its schema checked: consecutive row
        # groups of one file (the usual order) parse its footer once.
        self._file: tuple[str, pq.ParquetFile, contextlib.ExitStack] | None = None
        # Single-valued string columns are decoded straight into Arrow dictionaries, so each
        # distinct string is materialised and hashed once per row group.
        self._strings = [f.name for f in schema.sparse
                         if f.type == "string" and not f.multi_valued]

    def read(self, path: str, row_group: int, start: int, stop: int) -> Batch:
        """Rows ``[start, stop)`` of row group ``row_group`` of ``path`` (indices within it)."""
        decoded = self._decoded(path, row_group)
        _check_range(decoded, path, row_group, start, stop)
        return _batch(decoded, self.schema, start, stop)

    def batches(self, path: str, row_group: int, start: int, stop: int,
                batch_size: int) -> Iterator[Batch]:
        """Rows ``[start, stop)`` in batches of ``batch_size`` (the last may be shorter)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, found {batch_size}")
        for first in range(start, stop, batch_size):
            yield self.read(path, row_group, first, min(first + batch_size, stop))

    def close(self) -> None:
        """Drop the cache, close the last file and stop the threads (idle threads also end, and
        the file closes, when the reader is garbage-collected)."""
        self._cache.clear()
        self._close_file()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _decoded(self, path: str, row_group: int) -> _Decoded:
        key = (path, row_group)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        decoded = self._decode(path, row_group)
        self._cache[key] = decoded
        return decoded

    def _make_room(self) -> _Decoded | None:
        """Evict the least recently used row group if the cache is full, and return it: its
        arrays are reused, as batches never alias them."""
        if len(self._cache) < self.cache_row_groups:
            return None
        return self._cache.popitem(last=False)[1]

    def _parquet(self, path: str, where: str) -> pq.ParquetFile:
        """``path`` open, its schema checked (errors name ``where``); kept open until the next
        file or :meth:`close`."""
        if self._file is not None and self._file[0] == path:
            return self._file[1]
        self._close_file()
        stack = contextlib.ExitStack()
        parquet = stack.enter_context(open_parquet(path, read_dictionary=self._strings))
        mismatches = file_schema_problems(self.schema, parquet.schema_arrow)
        if mismatches:
            stack.close()
            column, why = mismatches[0]
            raise DataError(f"{where} column {column!r}: {why}")
        self._file = (path, parquet, stack)
        return parquet

    def _close_file(self) -> None:
        if self._file is not None:
            self._file[2].close()
            self._file = None

    def _decode(self, path: str, row_group: int) -> _Decoded:
        started = time.perf_counter()
        where = f"{path} row group {row_group}"
        parquet = self._parquet(path, where)
        if not 0 <= row_group < parquet.metadata.num_row_groups:
            raise DataError(f"{path}: row group {row_group} does not exist (expected 0 <= "
                            f"row group < {parquet.metadata.num_row_groups})")
        try:
            table = parquet.read_row_group(row_group, columns=self.schema.columns)
        except (OSError, pa.ArrowException) as exc:
            raise DataError(f"{where}: cannot decode ({exc}); expected a readable Parquet "
                            "row group") from exc
        converter = _Converter(self.schema, table.num_rows, where, spare=self._make_room())
        self._run(converter.jobs(table))
        self.decoded_row_groups += 1
        logger.debug("decoded %s in %.1f ms", where, (time.perf_counter() - started) * 1e3)
        return converter.result()

    def _run(self, jobs: Sequence[Job]) -> None:
        """Run ``jobs`` on the pool, or here with ``threads=1``; re-raise the first error once
        every job is done (no job outlives the call)."""
        if self.threads == 1:
            for job in jobs:
                job()
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="antdt-reader")
        errors = [f.exception() for f in [self._pool.submit(job) for job in jobs]]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first


def table_batch(table: pa.Table, schema: Schema, *, where: str = "table") -> Batch:
    """All rows of an in-memory Arrow table as one ``Batch`` (serving, tests): the same checks
    and conversions as :class:`ShardReader`; errors name ``where`` and the column."""
    mismatches = file_schema_problems(schema, table.schema)
    if mismatches:
        column, why = mismatches[0]
        raise DataError(f"{where} column {column!r}: {why}")
    converter = _Converter(schema, table.num_rows, where)
    for job in converter.jobs(table):
        job()
    return _batch(converter.result(), schema, 0, table.num_rows)


def concat(batches: Sequence[Batch]) -> Batch:
    """The rows of ``batches`` (at least one, the same sparse keys), in order, as one batch:
    each key's bags of every batch in turn (the layout stays key-major)."""
    if len(batches) == 1:
        return batches[0]
    sparse = [batch.sparse_features for batch in batches]
    keys = sparse[0].keys()
    for kjt in sparse[1:]:
        if kjt.keys() != keys:
            raise ValueError(f"batches with different sparse keys: {keys} and {kjt.keys()}")
    values = [kjt.values().split(kjt.length_per_key()) for kjt in sparse]
    lengths = [kjt.lengths().split(kjt.stride()) for kjt in sparse]
    parts = range(len(batches))
    joined = KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([values[b][k] for k in range(len(keys)) for b in parts]),
        lengths=torch.cat([lengths[b][k] for k in range(len(keys)) for b in parts]),
        stride=sum(kjt.stride() for kjt in sparse),
        length_per_key=[sum(kjt.length_per_key()[k] for kjt in sparse)
                        for k in range(len(keys))],
    )
    return Batch(dense_features=torch.cat([batch.dense_features for batch in batches]),
                 sparse_features=joined,
                 labels=torch.cat([batch.labels for batch in batches]))


def _check_range(decoded: _Decoded, path: str, row_group: int, start: int, stop: int) -> None:
    if not 0 <= start < stop <= decoded.num_rows:
        raise DataError(f"{path} row group {row_group}: row range [{start}, {stop}) is not "
                        f"inside the row group's {decoded.num_rows} rows "
                        "(expected 0 <= start < stop <= rows)")


def _batch(decoded: _Decoded, schema: Schema, start: int, stop: int) -> Batch:
    """Rows ``[start, stop)`` of ``decoded``, copied: a batch never aliases the cache."""
    size = stop - start
    if decoded.multi:
        values, lengths, length_per_key = _jagged(decoded, schema, start, stop)
    else:
        values = decoded.single[:, start:stop].flatten()
        lengths = np.ones(values.shape, dtype=np.int32)
        length_per_key = [size] * len(schema.sparse)
    sparse = KeyedJaggedTensor(
        keys=schema.sparse_names,
        values=torch.from_numpy(values),
        lengths=torch.from_numpy(lengths),
        stride=size,
        length_per_key=length_per_key,
    )
    return Batch(
        dense_features=torch.from_numpy(decoded.dense[:, start:stop].T.copy()),
        sparse_features=sparse,
        labels=torch.from_numpy(decoded.labels[start:stop].copy()),
    )


def _jagged(decoded: _Decoded, schema: Schema, start: int, stop: int
            ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], list[int]]:
    """KJT values, lengths and length per key of rows ``[start, stop)``, key-major."""
    size = stop - start
    values: list[npt.NDArray[np.int64]] = []
    lengths: list[npt.NDArray[np.int32]] = []
    length_per_key: list[int] = []
    ones = np.ones(size, dtype=np.int32)
    single_index = 0
    for feature in schema.sparse:
        bags = decoded.multi.get(feature.name)
        if bags is None:
            values.append(decoded.single[single_index, start:stop])
            lengths.append(ones)
            length_per_key.append(size)
            single_index += 1
        else:
            first, last = int(bags.offsets[start]), int(bags.offsets[stop])
            values.append(bags.values[first:last])
            lengths.append(np.diff(bags.offsets[start:stop + 1]).astype(np.int32))
            length_per_key.append(last - first)
    return np.concatenate(values), np.concatenate(lengths), length_per_key
