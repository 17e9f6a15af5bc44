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

Reading copies rows chunk by chunk (:data:`READ_CHUNK_BYTES`) from the file straight into the
target tensor, and writing streams the tensors out with their checksum computed on the way: a
rank holds one chunk more than its shards. No file is mapped or read whole: the Dask nanny
counts a mapped file's resident pages in the worker's memory.
"""

from __future__ import annotations

import hashlib
import json
import os
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
    dense file, e.g. a checkpoint manifest's): their headers are read here, their blocks when
    :meth:`fill` asks for them. Raises :class:`ValueError` naming what is missing or does not
    match (a rank's file, a table)."""

    def __init__(self, folder: str, names: Iterable[str]) -> None:
        self.folder = folder
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
        for rank in range(self.world_size):
            self._read_header(_join(folder, rank_file(rank, self.world_size)))

    def _read_header(self, path: str) -> None:
        with fsspec.open(path, "rb") as f:
            start = f.read(len(MAGIC) + 8)
            if len(start) < len(MAGIC) + 8 or start[:len(MAGIC)] != MAGIC:
                raise ValueError(f"{path}: not a model shard file (expected it to start with "
                                 f"{MAGIC!r}, found {start[:len(MAGIC)]!r})")
            (length,) = struct.unpack("<Q", start[len(MAGIC):])
            header = json.loads(f.read(length))
        if header.get("format") != FORMAT:
            raise ValueError(f"{path}: shard format {header.get('format')!r}; expected {FORMAT}")
        tables = [Table(t["name"], t["key"], (t["shape"][0], t["shape"][1]), list(t["states"]))
                  for t in header["tables"]]
        if self.tables and tables != self.tables:
            raise ValueError(f"{path}: its tables differ from the other ranks' files")
        self.tables = tables
        data = len(MAGIC) + 8 + length
        for entry in header["blocks"]:
            block = Block(entry["table"], entry["state"], (entry["rows"][0], entry["rows"][1]),
                          (entry["cols"][0], entry["cols"][1]))
            self._stored.setdefault((block.table, block.state), []).append(_Stored(
                path, data + entry["offset"], block, tuple(entry["shape"]),
                _DTYPES[entry["dtype"]]))

    def dense(self) -> dict[str, Any]:
        """The model's part that is not tables (as :func:`write_dense` was given it)."""
        with fsspec.open(_join(self.folder, DENSE), "rb") as f:
            dense: dict[str, Any] = torch.load(f, map_location="cpu", weights_only=True)
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


def read_full_state(folder: str, names: Iterable[str]) -> dict[str, Any]:
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
