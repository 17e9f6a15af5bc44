"""A model written in parts by the ranks of a synchronous group, each rank its own shards: the form
a sync job's checkpoint and final model take when the whole model would not fit one worker
(:meth:`models.sharded.ShardedTrainStep.write_shards`). Any number of ranks loads it back, each
reading only the blocks it holds (:meth:`~models.sharded.ShardedTrainStep.load_shards`), and
where the whole model fits it becomes a :class:`~models.train_step.TrainStep` state
(:func:`read_full_state`).

One folder holds, for a group of W ranks::

    model-00000-of-00003.bin   rank 0's blocks of the tables and of their optimiser states
    model-00001-of-00003.bin   rank 1's ...
    model-00002-of-00003.bin
    model-dense.pt             (rank 0) the rest: dense weights, the dense optimiser's state, the
                               sparse step counter, rows_trained, the model's keys in order

A rank's file is ``MAGIC | header length (u64, little-endian) | header (JSON) | data``. The
header names the model's tables (``name``, ``key``, ``shape``, ``states``) and the rank's
blocks (``table``, ``state``, ``rows``, ``cols``, ``shape``, ``dtype``, ``offset`` into the
data); the data is each block's raw bytes in C order, one block after the other.

Blocks are in the unsharded table's coordinates whatever the sharding, ``rows = [first, count]``
and ``cols = [first, count]``, so a model written by 3 ranks loads on 2 or 5. A block of a
weight or of an element-wise state (Adagrad's) is ``(rows, cols)``. A row-wise state (row-wise
Adagrad's one float per row) is ``(rows,)``, and ``cols`` names the columns it was kept over:
FBGEMM keeps it per column shard (the mean of that shard's squared gradients), and reading gives
each row the column-weighted mean of those, which is the unsharded state exactly (as
:meth:`~models.sharded.ShardedTrainStep.full_state` does).

Loading checks what it reads. Given the files' sizes and sha256 (a checkpoint's manifest, a
saved model's ``files``), :class:`ShardFiles` compares every size at once and each file's sha256,
streamed a chunk at a time, before its first bytes are used (a rank hashes only the files it reads
from). A header is bounded (:data:`MAX_HEADER_BYTES`, and the file's size) and every field is
checked: the blocks must lie inside their tables and inside the file, and no two blocks of a table
may overlap, so a rank's file mixed in from another group or a corrupt one is refused, in one
:class:`ValueError` naming the file and what is wrong, instead of leaving rows unset.

Reading copies rows chunk by chunk (:data:`READ_CHUNK_BYTES`) from the file straight into the
target tensor, and writing streams the tensors out with their checksum computed on the way: a
rank holds one chunk more than its shards. No file is mapped or read whole: the Dask nanny
counts a mapped file's resident pages in the worker's memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import posixpath
import re
import secrets
import struct
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import IO, Any, NamedTuple

import fsspec
import torch

MAGIC = b"ANTDTSH1"
FORMAT = 1
DENSE = "model-dense.pt"
"""The file of everything but the tables (written by rank 0)."""
READ_CHUNK_BYTES = 16 << 20
"""At most this many bytes of a block are read (or written) at once."""
MAX_HEADER_BYTES = 64 << 20
"""A rank file's header is refused above this (thousands of tables take a few MiB)."""

_RANK_FILE = re.compile(r"^model-(\d{5})-of-(\d{5})\.bin$")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}


class Table(NamedTuple):
    """One embedding table as the unsharded model names it."""

    name: str               # the table (= its feature)
    key: str                # its weight's key in ``model.state_dict()``
    shape: tuple[int, int]  # (num_embeddings, embedding_dim)
    states: list[str]       # its fused optimiser state keys, e.g. ["C1.weight.momentum_1"]


class Block(NamedTuple):
    """Where a tensor sits in its table: a block of the weight (``state`` None) or of one
    optimiser state, ``rows`` and ``cols`` as ``(first, count)`` (see the module docstring)."""

    table: str
    state: str | None
    rows: tuple[int, int]
    cols: tuple[int, int]


def rank_file(rank: int, world_size: int) -> str:
    """The name of rank ``rank``'s file in a group of ``world_size``."""
    return f"model-{rank:05d}-of-{world_size:05d}.bin"


def _join(folder: str, name: str) -> str:
    return posixpath.join(folder.rstrip("/") or "/", name)


class _Out:
    """A file written atomically (on a local file system a temporary file renamed over the path
    once complete and fsync'ed; elsewhere one put, as object stores replace whole objects), its
    size and sha256 counted as the bytes pass."""

    def __init__(self, path: str) -> None:
        self.fs, self.path = fsspec.core.url_to_fs(path)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) \
            else (self.fs.protocol,)
        self.local = "file" in protocols
        if self.local:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self.target = f"{self.path}.tmp-{secrets.token_hex(4)}" if self.local else self.path
        self.file: IO[bytes] = open(self.target, "wb") if self.local \
            else self.fs.open(self.target, "wb")
        self.hash = hashlib.sha256()
        self.bytes = 0

    def write(self, data: bytes | memoryview) -> int:
        self.hash.update(data)
        self.bytes += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def digest(self) -> dict[str, Any]:
        """The file's size and checksum, as a checkpoint's manifest lists them."""
        return {"bytes": self.bytes, "sha256": self.hash.hexdigest()}

    def __enter__(self) -> _Out:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if error is not None or not self.local:
            self.file.close()
            if error is not None and self.local:
                os.unlink(self.target)
            return
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.target, self.path)


def _write_tensor(out: _Out, tensor: torch.Tensor) -> None:
    """``tensor``'s bytes in C order, a chunk of rows at a time (no copy of a contiguous one)."""
    flat = tensor.detach()
    if flat.dim() == 0 or flat.numel() == 0:
        out.write(flat.reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return
    row_bytes = max(1, flat[0].numel() * flat.element_size())
    step = max(1, READ_CHUNK_BYTES // row_bytes)
    for first in range(0, flat.shape[0], step):
        part = flat[first:first + step].contiguous().cpu().reshape(-1)
        out.write(part.view(torch.uint8).numpy().data)


def write_rank(folder: str, rank: int, world_size: int, tables: Sequence[Table],
               blocks: Sequence[tuple[Block, torch.Tensor]]) -> tuple[str, dict[str, Any]]:
    """Write rank ``rank``'s ``blocks`` (each with its tensor: views of the training storage are
    fine, nothing is copied whole) into ``folder``; the file's name and its size and sha256."""
    entries = []
    offset = 0
    for block, tensor in blocks:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"{block.table} ({block.state or 'weight'}): dtype {tensor.dtype} "
                             f"cannot be written; expected one of {sorted(_DTYPES)}")
        entries.append({"table": block.table, "state": block.state, "rows": list(block.rows),
                        "cols": list(block.cols), "shape": list(tensor.shape), "dtype": dtype,
                        "offset": offset})
        offset += tensor.numel() * tensor.element_size()
    header = json.dumps({"format": FORMAT, "rank": rank, "world_size": world_size,
                         "tables": [t._asdict() for t in tables], "blocks": entries}).encode()
    name = rank_file(rank, world_size)
    with _Out(_join(folder, name)) as out:
        out.write(MAGIC)
        out.write(struct.pack("<Q", len(header)))
        out.write(header)
        for _, tensor in blocks:
            _write_tensor(out, tensor)
    return name, out.digest()


def write_dense(folder: str, dense: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Write the model's part that is not tables (``torch.save`` of ``dense``) into ``folder``;
    the file's name and its size and sha256."""
    with _Out(_join(folder, DENSE)) as out:
        torch.save(dict(dense), out)  # type: ignore[arg-type]  # a writable file object
    return DENSE, out.digest()


class _Stored(NamedTuple):
    """A block in a rank's file: where its bytes start (``at``) and their layout."""

    path: str
    at: int
    block: Block
    shape: tuple[int, ...]
    dtype: torch.dtype


class ShardFiles:
    """The files one group of ranks wrote into ``folder`` (``names``: the rank files and the
    dense file; as a mapping to each file's ``bytes`` and ``sha256``, e.g. a checkpoint
    manifest's, they are verified, see the module docstring): their headers are read here, their
    blocks when :meth:`fill` asks for them. Raises :class:`ValueError` naming what is missing,
    corrupt or does not match (a rank's file, a table)."""

    def __init__(self, folder: str,
                 names: Iterable[str] | Mapping[str, Mapping[str, Any]]) -> None:
        self.folder = folder
        self._expected: dict[str, Mapping[str, Any]] = \
            {name: dict(names[name] or {}) for name in names} if isinstance(names, Mapping) \
            else {}
        names = sorted(set(names))
        ranks = {int(m[1]): int(m[2]) for m in map(_RANK_FILE.match, names) if m}
        worlds = set(ranks.values())
        if DENSE not in names or len(worlds) != 1 or \
                sorted(ranks) != list(range(next(iter(worlds)))):
            raise ValueError(f"{folder}: expected {DENSE} and one file per rank "
                             f"model-<rank>-of-<ranks>.bin of one group, found {names}")
        self.world_size = next(iter(worlds))
        self.tables: list[Table] = []
        self._stored: dict[tuple[str, str | None], list[_Stored]] = {}
        self._verified: set[str] = set()
        sizes = {name: self._size(name) for name in
                 [DENSE, *(rank_file(r, self.world_size) for r in range(self.world_size))]}
        for rank in range(self.world_size):
            name = rank_file(rank, self.world_size)
            self._read_header(_join(folder, name), rank, sizes[name])
        for stored in self._stored.values():
            _refuse_overlaps(stored)

    def _size(self, name: str) -> int:
        """``name``'s size, checked against the size it should have where that is given."""
        path = _join(self.folder, name)
        fs, local = fsspec.core.url_to_fs(path)
        try:
            size = int(fs.size(local))
        except FileNotFoundError:
            raise ValueError(f"{path}: missing (a part of the model in {self.folder})") from None
        expected = self._expected.get(name, {}).get("bytes")
        if expected is not None and size != expected:
            raise ValueError(f"{path}: {size} bytes, expected {expected} (its manifest's): the "
                             "part is truncated, corrupt or from another model")
        return size

    def _verify(self, path: str) -> None:
        """Check ``path``'s sha256 against its manifest's, once, streamed a chunk at a time."""
        name = posixpath.basename(path)
        expected = self._expected.get(name, {}).get("sha256")
        if expected is None or path in self._verified:
            return
        digest = hashlib.sha256()
        with fsspec.open(path, "rb") as f:
            while chunk := f.read(READ_CHUNK_BYTES):
                digest.update(chunk)
        if digest.hexdigest() != expected:
            raise ValueError(f"{path}: sha256 {digest.hexdigest()}, expected {expected} (its "
                             "manifest's): the part is corrupt or from another model")
        self._verified.add(path)

    def _read_header(self, path: str, rank: int, size: int) -> None:
        start_bytes = len(MAGIC) + 8
        with fsspec.open(path, "rb") as f:
            start = f.read(start_bytes)
            if len(start) < start_bytes or start[:len(MAGIC)] != MAGIC:
                raise ValueError(f"{path}: not a model shard file (expected it to start with "
                                 f"{MAGIC!r}, found {start[:len(MAGIC)]!r})")
            (length,) = struct.unpack("<Q", start[len(MAGIC):])
            if length > min(MAX_HEADER_BYTES, size - start_bytes):
                raise ValueError(f"{path}: corrupt header: it says it has {length} bytes, the "
                                 f"file has {size} (at most {MAX_HEADER_BYTES} are read)")
            raw = f.read(length)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: corrupt header: not JSON ({exc})") from None
        data = start_bytes + length
        tables, blocks = _Header(path, data, size).parse(header, rank, self.world_size)
        if self.tables and tables != self.tables:
            raise ValueError(f"{path}: its tables differ from the other ranks' files")
        self.tables = tables
        for stored in blocks:
            self._stored.setdefault((stored.block.table, stored.block.state), []).append(stored)

    def dense(self) -> dict[str, Any]:
        """The model's part that is not tables (as :func:`write_dense` was given it)."""
        path = _join(self.folder, DENSE)
        self._verify(path)
        try:
            with fsspec.open(path, "rb") as f:
                dense = torch.load(f, map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable dense part: "
                             f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                             ) from None
        if not isinstance(dense, dict) or "model" not in dense:
            raise ValueError(f"{path}: not a dense part (expected a dict with 'model', found "
                             f"{type(dense).__name__})")
        return dense

    def state_dims(self, table: Table, state: str) -> int:
        """1 for a row-wise state (one value per row), 2 for an element-wise one."""
        stored = self._stored.get((table.key, state))
        if not stored:
            raise ValueError(f"{self.folder}: no block of {table.key}'s state {state!r}")
        return len(stored[0].shape)

    @torch.no_grad()
    def fill(self, out: torch.Tensor, table: Table, state: str | None, rows: tuple[int, int],
             cols: tuple[int, int]) -> None:
        """Fill ``out`` with the block ``rows`` x ``cols`` of ``table``'s weight (``state``
        None) or of its ``state``: ``(rows, cols)``, or ``(rows,)`` for a row-wise state (the
        column-weighted mean of the stored column shards' values, see the module docstring).
        Raises :class:`ValueError` when the files do not cover the block."""
        stored = self._stored.get((table.key, state), [])
        first, count = rows
        if out.dim() == 1:
            out.zero_()
            weight = torch.zeros(count, dtype=torch.float64)
            for item in stored:
                share = item.block.cols[1] / table.shape[1]
                for low, part in self._rows(item, first, count):
                    out[low - first:low - first + part.shape[0]] += part.to(out.dtype) * share
                    weight[low - first:low - first + part.shape[0]] += share
            covered = bool(((weight - 1).abs() < 1e-9).all()) if count else True
        else:
            column, width = cols
            done = 0
            for item in stored:
                left = max(column, item.block.cols[0])
                right = min(column + width, item.block.cols[0] + item.block.cols[1])
                if left >= right:
                    continue
                for low, part in self._rows(item, first, count):
                    source = part[:, left - item.block.cols[0]:right - item.block.cols[0]]
                    out[low - first:low - first + part.shape[0],
                        left - column:right - column] = source
                    done += source.numel()
            covered = done == count * width
        if not covered:
            raise ValueError(f"{self.folder}: the files do not cover rows {rows}, columns "
                             f"{cols} of {table.key} ({state or 'weight'}): a rank's file is "
                             "missing or was written by another group")

    def _rows(self, item: _Stored, first: int, count: int) -> Iterable[tuple[int, torch.Tensor]]:
        """The rows of ``item`` inside ``[first, first + count)``, a chunk at a time: ``(the
        chunk's first row in table coordinates, its values)``."""
        low = max(first, item.block.rows[0])
        high = min(first + count, item.block.rows[0] + item.block.rows[1])
        if low >= high:
            return
        self._verify(item.path)
        row_shape = item.shape[1:]
        row_bytes = max(1, int(torch.Size(row_shape).numel()) * item.dtype.itemsize)
        step = max(1, READ_CHUNK_BYTES // row_bytes)
        with fsspec.open(item.path, "rb") as f:
            f.seek(item.at + (low - item.block.rows[0]) * row_bytes)
            for start in range(low, high, step):
                part = torch.empty((min(step, high - start), *row_shape), dtype=item.dtype)
                view = part.view(torch.uint8).numpy()
                if f.readinto(view) != view.nbytes:
                    raise ValueError(f"{item.path}: truncated (a block of {item.block.table} "
                                     f"ends past the end of the file)")
                yield start, part


def _refuse_overlaps(stored: Sequence[_Stored]) -> None:
    """Refuse blocks of one table's weight (or state) that overlap: with two files of different
    groups mixed, the coverage counted would pass with rows left unset."""
    ordered = sorted(stored, key=lambda item: item.block.rows[0])
    open_: list[_Stored] = []
    for item in ordered:
        (top, _), (left, width) = item.block.rows, item.block.cols
        open_ = [o for o in open_ if o.block.rows[0] + o.block.rows[1] > top]
        for other in open_:
            o_left, o_width = other.block.cols
            if left < o_left + o_width and o_left < left + width and item.block.rows[1] and \
                    other.block.rows[1]:
                raise ValueError(
                    f"{item.path}: its block rows {item.block.rows}, columns {item.block.cols} "
                    f"of {item.block.table} ({item.block.state or 'weight'}) overlaps "
                    f"{other.path}'s rows {other.block.rows}, columns {other.block.cols}: the "
                    "files are not of one group")
        open_.append(item)


class _Header:
    """The checks of one rank file's header (``data``: where its blocks' bytes begin,
    ``size``: the file's), each failure a :class:`ValueError` naming the file and the field."""

    def __init__(self, path: str, data: int, size: int) -> None:
        self.path, self.data, self.size = path, data, size

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: corrupt header: {what}")

    def field(self, where: Mapping[str, Any], key: str, kind: type, what: str) -> Any:
        value = where.get(key) if isinstance(where, Mapping) else None
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(f"{what}{key!r} must be a {kind.__name__}, found {value!r:.80}")
        return value

    def span(self, entry: Mapping[str, Any], key: str, what: str, bound: int) -> tuple[int, int]:
        value = self.field(entry, key, list, what)
        if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool)
                                      for v in value) \
                or value[0] < 0 or value[1] < 0 or value[0] + value[1] > bound:
            raise self.fail(f"{what}{key!r} must be [first, count] inside 0..{bound}, found "
                            f"{value!r:.80}")
        return value[0], value[1]

    def parse(self, header: Any, rank: int, world_size: int
              ) -> tuple[list[Table], list[_Stored]]:
        if not isinstance(header, dict):
            raise self.fail(f"expected an object, found {type(header).__name__}")
        if header.get("format") != FORMAT:
            raise ValueError(f"{self.path}: shard format {header.get('format')!r}; expected "
                             f"{FORMAT}")
        if header.get("rank") != rank or header.get("world_size") != world_size:
            raise self.fail(f"it says rank {header.get('rank')!r} of "
                            f"{header.get('world_size')!r}, its name rank {rank} of {world_size}")
        tables = []
        for i, t in enumerate(self.field(header, "tables", list, "")):
            what = f"table {i}: "
            shape = self.field(t, "shape", list, what)
            if len(shape) != 2 or not all(isinstance(v, int) and v >= 0 for v in shape):
                raise self.fail(f"{what}'shape' must be two sizes, found {shape!r:.80}")
            states = self.field(t, "states", list, what)
            if not all(isinstance(state, str) for state in states):
                raise self.fail(f"{what}'states' must be names, found {states!r:.80}")
            tables.append(Table(self.field(t, "name", str, what), self.field(t, "key", str, what),
                                (shape[0], shape[1]), list(states)))
        by_key = {t.key: t for t in tables}
        blocks = []
        for i, entry in enumerate(self.field(header, "blocks", list, "")):
            what = f"block {i}: "
            table = by_key.get(self.field(entry, "table", str, what))
            if table is None:
                raise self.fail(f"{what}table {entry['table']!r:.80} is not one of its tables")
            state = entry.get("state")
            if state is not None and state not in table.states:
                raise self.fail(f"{what}state {state!r:.80} is not one of {table.key}'s "
                                f"{table.states}")
            rows = self.span(entry, "rows", what, table.shape[0])
            cols = self.span(entry, "cols", what, table.shape[1])
            shape = tuple(self.field(entry, "shape", list, what))
            if shape not in ((rows[1], cols[1]), (rows[1],)) or (state is None and
                                                                  len(shape) != 2):
                raise self.fail(f"{what}shape {list(shape)!r:.80} does not fit rows {rows}, "
                                f"columns {cols}")
            dtype = _DTYPES.get(self.field(entry, "dtype", str, what))
            if dtype is None:
                raise self.fail(f"{what}dtype {entry['dtype']!r:.80} is not one of "
                                f"{sorted(_DTYPES)}")
            offset = self.field(entry, "offset", int, what)
            end = self.data + offset + int(torch.Size(shape).numel()) * dtype.itemsize
            if offset < 0 or end > self.size:
                raise self.fail(f"{what}its bytes end at {end}, past the file's {self.size}: "
                                "truncated or corrupt")
            blocks.append(_Stored(self.path, self.data + offset,
                                  Block(table.key, state, rows, cols), shape, dtype))
        return tables, blocks


def read_full_state(folder: str, names: Iterable[str] | Mapping[str, Mapping[str, Any]]
                    ) -> dict[str, Any]:
    """The whole model written in ``folder`` as one state in
    :meth:`models.train_step.TrainStep.state_dict`'s format (where it fits: a plain
    :class:`~models.train_step.TrainStep` or an async job resuming a sync job's checkpoint)."""
    files = ShardFiles(folder, names)
    dense = files.dense()
    tables = {t.key: t for t in files.tables}
    model: dict[str, torch.Tensor] = {}
    for key in dense["keys"]:
        table = tables.get(key)
        if table is None:
            model[key] = dense["model"][key]
            continue
        model[key] = torch.empty(table.shape)
        files.fill(model[key], table, None, (0, table.shape[0]), (0, table.shape[1]))
    sparse: dict[str, dict[str, torch.Tensor]] = {}
    for table in files.tables:
        if not table.states:  # a stateless optimiser (SGD) has no entry, as unsharded
            continue
        sparse[f"{table.name}.weight"] = {}
        for state in table.states:
            full = torch.empty(table.shape[:files.state_dims(table, state)])
            files.fill(full, table, state, (0, table.shape[0]), (0, table.shape[1]))
            sparse[f"{table.name}.weight"][state] = full
    return {"model": model, "dense_optimizer": dense["dense_optimizer"],
            "sparse_optimizer": {"state": sparse}, "sparse_iter": dense["sparse_iter"],
            "rows_trained": int(dense["rows_trained"])}
