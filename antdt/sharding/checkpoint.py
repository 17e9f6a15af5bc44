"""The shard ledger's checkpoint: what it holds (:class:`LedgerState`), its byte format, and an
atomic write to any fsspec path.

A checkpoint is the ledger as it would be if every worker were removed at that moment: live
leases are written as queue-front pieces from their synced offset (the workers are gone when it
is restored) and their trained-but-unsynced rows count as retrained. Shards and the epoch
permutation are not stored; they are recomputed from the row groups and the seed.

Checkpoint format (version 2)
-----------------------------
``MAGIC`` (8 bytes), a little-endian uint32 header length, a UTF-8 JSON header (configuration,
paths, counters, rows done per epoch, epoch cursor, quarantine records, array table), then the
raw little-endian arrays it lists: the row-group table and the queue-front pieces.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import fsspec
import numpy as np

from antdt.errors import LedgerError
from antdt.sharding.leases import QuarantineRecord

T = TypeVar("T")
FORMAT_VERSION = 2
MAGIC = b"ANTDTLG\x00"
MAX_BYTES = 256 * 2**20
"""Largest ledger checkpoint read (a million row groups write about 35 MB)."""


RENAMED = {"rows_duplicated": "rows_retrained"}
"""Counters as checkpoints of earlier versions name them."""


@dataclass(frozen=True)
class LedgerState:
    """Everything a dynamic ledger needs to resume: its configuration, the row-group table
    (``rg_file`` indexes ``paths``), the epoch cursor, the counters, the quarantine records and
    the queue-front pieces ``(epoch, shard, start, stop)``, shape ``(n, 4)`` int64."""

    job: str
    shard_rows: int
    batch_rows: int
    epochs: int
    seed: int
    max_claim_rows: int
    paths: list[str]
    rg_file: np.ndarray
    rg_group: np.ndarray
    rg_rows: np.ndarray
    epoch: int
    pos: int
    next_lease_id: int
    stopped: str | None
    counters: dict[str, int]
    done_by_epoch: list[int]
    quarantine: list[QuarantineRecord]
    front: np.ndarray


def encode(state: LedgerState) -> bytes:
    """``state`` in the format of the module docstring."""
    arrays: dict[str, np.ndarray] = {"rg_file": state.rg_file, "rg_group": state.rg_group,
                                     "rg_rows": state.rg_rows, "front": state.front}
    table, offset = {}, 0
    for name, array in arrays.items():
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        arrays[name] = array
        table[name] = {"dtype": array.dtype.str, "shape": list(array.shape),
                       "offset": offset, "nbytes": array.nbytes}
        offset += array.nbytes
    header = {
        "version": FORMAT_VERSION, "job": state.job, "shard_rows": state.shard_rows,
        "batch_rows": state.batch_rows, "epochs": state.epochs, "seed": state.seed,
        "max_claim_rows": state.max_claim_rows, "paths": state.paths,
        "epoch": state.epoch, "pos": state.pos, "next_lease_id": state.next_lease_id,
        "stopped": state.stopped, "counters": state.counters,
        "done_by_epoch": state.done_by_epoch,
        "quarantine": [list(record) for record in state.quarantine],
        "arrays": table,
    }
    blob = json.dumps(header).encode()
    return b"".join([MAGIC, struct.pack("<I", len(blob)), blob,
                     *(array.tobytes() for array in arrays.values())])


def decode(data: bytes) -> LedgerState:
    """The :class:`LedgerState` that :func:`encode` wrote; a :class:`LedgerError` for anything
    else (its message names what is wrong, never the file's bytes: the path may be any file)."""
    if data[:8] != MAGIC:
        raise LedgerError(f"not an antdt ledger checkpoint (it does not start with {MAGIC!r})")
    try:
        return _decode(data)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, struct.error) as e:
        raise LedgerError(f"a damaged antdt ledger checkpoint ({type(e).__name__} while "
                          "decoding it)") from e


def restored(data: bytes, build: Callable[[LedgerState], T]) -> T:
    """``build`` (a ledger from its state) applied to :func:`decode`'s state of ``data``; a
    :class:`LedgerError` naming no bytes of ``data`` for a state it cannot build from."""
    state = decode(data)
    try:
        return build(state)
    except (ValueError, IndexError, TypeError, KeyError, AttributeError) as e:
        raise LedgerError(f"a damaged antdt ledger checkpoint ({type(e).__name__} while "
                          "restoring it)") from e


def _decode(data: bytes) -> LedgerState:
    (length,) = struct.unpack("<I", data[8:12])
    header = json.loads(data[12:12 + length])
    if header.get("version") != FORMAT_VERSION:
        raise LedgerError(f"ledger checkpoint version {header.get('version')!r} is not "
                          f"supported; expected {FORMAT_VERSION}")
    body = memoryview(data)[12 + length:]
    arrays = {}
    for name, spec in header["arrays"].items():
        raw = body[spec["offset"]:spec["offset"] + spec["nbytes"]]
        arrays[name] = np.frombuffer(raw, dtype=np.dtype(spec["dtype"])).reshape(spec["shape"])
    return LedgerState(
        job=header["job"], shard_rows=header["shard_rows"], batch_rows=header["batch_rows"],
        epochs=header["epochs"], seed=header["seed"], max_claim_rows=header["max_claim_rows"],
        paths=header["paths"], rg_file=arrays["rg_file"], rg_group=arrays["rg_group"],
        rg_rows=arrays["rg_rows"], epoch=int(header["epoch"]), pos=int(header["pos"]),
        next_lease_id=int(header["next_lease_id"]), stopped=header["stopped"],
        counters={RENAMED.get(name, name): int(value)
                  for name, value in header["counters"].items()},
        done_by_epoch=[int(rows) for rows in header["done_by_epoch"]],
        quarantine=[QuarantineRecord(*record) for record in header["quarantine"]],
        front=arrays["front"])


def read(path: str, limit: int = MAX_BYTES) -> bytes:
    """The bytes at an fsspec ``path`` (``FileNotFoundError`` when there are none), at most
    ``limit`` of them (:class:`LedgerError` for a larger file)."""
    with fsspec.open(path, "rb") as f:
        data: bytes = f.read(limit + 1)
    if len(data) > limit:
        raise LedgerError(f"{path} is larger than a ledger checkpoint may be ({limit:,} bytes)")
    return data


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to an fsspec ``path``: on a local file system a temporary file in the same
    folder, fsync'ed and renamed over ``path`` (readers see the old or the new file, never half of
    one); elsewhere a single put (object stores replace whole objects)."""
    fs, fs_path = fsspec.core.url_to_fs(path)
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" not in protocols:
        with fs.open(fs_path, "wb") as f:
            f.write(data)
        return
    os.makedirs(os.path.dirname(os.path.abspath(fs_path)), exist_ok=True)
    tmp = f"{fs_path}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, fs_path)
