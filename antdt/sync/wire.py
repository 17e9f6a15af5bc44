"""What the async mode's sync sends over Dask comms: the handlers' replies as TypedDicts, and
tensors as numpy arrays (each its own serialized frame), never through the scheduler. A list of
dense parameters travels packed into one frame (:class:`Packed`): every frame costs both ends of
a pull time on their event loops, and the default DLRM's dense snapshot is 10 tensors. A mask of
rows travels as bits (:func:`mask_to_bits`): 1/8 byte a row; row ids as int32 when they fit (half
the bytes of int64); a dtype numpy lacks (bfloat16 deltas) as integers of its width, named."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, TypedDict

import numpy as np
import torch
from distributed.protocol import to_serialize

from antdt.errors import SyncError
from antdt.sync.embeddings import LogEntry
from antdt.sync.groups import Answer, FinalStep
from antdt.sync.replica import LeaderRows, PeerPayload, ReplicaSnapshot

PLUGIN_NAME = "antdt-sync"
"""Name of both halves: ``scheduler.plugins[PLUGIN_NAME]`` and ``worker.plugins[PLUGIN_NAME]``."""


class GroupMsg(TypedDict):
    """Reply of ``antdt_sync_group``: ``round``/``members`` are set when ``kind`` is "group";
    "cut" says the worker reaches no other member (:meth:`~antdt.sync.SyncScheduler.isolated`)."""

    kind: Literal["group", "wait", "alone", "cut"]
    round: int | None
    members: list[str]
    final: bool
    members_version: int


class MembersMsg(TypedDict):
    """Reply of ``antdt_sync_members``: the live members and those that left the job, each
    with the rows the ledger counted synced when it left (every replica takes its entries past
    them out again)."""

    members: list[str]
    members_version: int
    departed: dict[str, int]


class JoinMsg(TypedDict):
    """Reply of ``antdt_sync_join``: ``settled`` once every other member applied a member list
    naming the joiner (else ``waiting`` names them: ask again); ``bootstrap`` when the worker
    joined mid-job and must adopt a member's snapshot."""

    settled: bool
    bootstrap: bool
    waiting: list[str]
    members: list[str]
    members_version: int
    departed: dict[str, int]


class FinalMsg(TypedDict):
    """Reply of ``antdt_sync_complete``: the worker's next ``step`` in the final round (see
    :meth:`~antdt.sync.SyncScheduler.final_step`) and the ``leader`` whose rows the others
    adopt."""

    step: FinalStep
    leader: str | None


class EntryMsg(TypedDict):
    """One :class:`~antdt.sync.LogEntry`: ``ids`` (k,) int32 or int64 and ``deltas`` (k, dim) as
    numpy arrays (wrapped in ``to_serialize`` on the way out), ``dtype`` the deltas' torch dtype
    (``"bfloat16"`` arrives as int16)."""

    seq: int
    rows_offset: int
    ids: Any
    deltas: Any
    dtype: str


class Packed(TypedDict):
    """A list of tensors in one frame: ``data`` their bytes (a uint8 numpy array, wrapped in
    ``to_serialize`` on the way out), each tensor's starting at a multiple of
    :data:`PACK_ALIGN`; ``tensors`` each one's dtype name and shape, in order."""

    data: Any
    tensors: list[tuple[str, list[int]]]


class PullMsg(TypedDict):
    """Reply of a worker's ``antdt_sync_pull``: a :class:`~antdt.sync.PeerPayload`."""

    source: str
    entries: list[EntryMsg]
    dense: Packed | None
    layout: str
    confirmed: int


class SnapshotMsg(TypedDict):
    """Reply of a worker's ``antdt_sync_snapshot``: a :class:`~antdt.sync.ReplicaSnapshot`, the
    tables as numpy arrays, the changed rows as bits, the provisional entries as in a pull."""

    source: str
    dense: Packed
    tables: dict[str, Any]
    applied: dict[str, int]
    changed: Any
    kept: dict[str, list[EntryMsg]]
    confirmed: dict[str, int]


class RowsMsg(TypedDict):
    """Reply of the final leader's ``antdt_sync_rows``: a :class:`~antdt.sync.LeaderRows`, the
    tensors as numpy arrays (the request carries the requester's changed rows as bits)."""

    source: str
    ids: Any
    rows: Any
    dense: Packed
    applied: dict[str, int]


def _tensor(value: Any) -> torch.Tensor:
    """A received array as a tensor, copied only when its frame is a read-only buffer."""
    array = np.asarray(value)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def _array(tensor: torch.Tensor) -> Any:
    return to_serialize(tensor.detach().cpu().numpy())


_AS_INTEGERS = {torch.bfloat16: torch.int16}
"""Tensor dtypes numpy has no type for: they travel as integers of the same width (a view)."""


def _typed_array(tensor: torch.Tensor) -> tuple[Any, str]:
    """``tensor`` as a numpy array, whatever its dtype, and the name of that dtype."""
    as_integers = _AS_INTEGERS.get(tensor.dtype)
    sent = tensor if as_integers is None else tensor.view(as_integers)
    return _array(sent), _dtype_name(tensor.dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    """What ``dtype`` is called on the wire (its name in ``torch``; see :func:`_torch_dtype`)."""
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str, what: str) -> torch.dtype:
    """The torch dtype called ``name``; :class:`SyncError` (naming ``what`` was sent) if none
    is."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise SyncError(f"{what}: {name!r} is not a torch dtype")
    return dtype


def _typed_tensor(value: Any, dtype: str) -> torch.Tensor:
    """Inverse of :func:`_typed_array`; :class:`SyncError` when ``dtype`` is not a torch dtype
    or not what the array holds."""
    wanted = _torch_dtype(dtype, "deltas")
    tensor = _tensor(value)
    if tensor.dtype == wanted:
        return tensor
    if _AS_INTEGERS.get(wanted) != tensor.dtype:
        raise SyncError(f"deltas: {dtype} sent as {tensor.dtype}, expected "
                        f"{_AS_INTEGERS.get(wanted, wanted)}")
    return tensor.view(wanted)


PACK_ALIGN = 8
"""In a :class:`Packed` frame each tensor's bytes start at a multiple of this (the widest
element size), so each one is a view of the received frame, not a copy."""


def _padded(nbytes: int) -> int:
    return -(-nbytes // PACK_ALIGN) * PACK_ALIGN


def pack(tensors: Sequence[torch.Tensor]) -> Packed:
    """``tensors`` (any dtypes, shapes and devices) as one frame (see :class:`Packed`); the
    padding between them is zeros. The frame is assembled on the first tensor's device and
    crosses to host memory once (a GPU's dense snapshot in one copy, not one per tensor)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    device = tensors[0].device if tensors else torch.device("cpu")
    data = torch.zeros(sum(_padded(n) for n in sizes), dtype=torch.uint8, device=device)
    offset = 0
    for tensor, size in zip(tensors, sizes):
        data[offset:offset + size] = tensor.detach().reshape(-1).view(torch.uint8)
        offset += _padded(size)
    return {"data": to_serialize(data.cpu().numpy()),
            "tensors": [(_dtype_name(t.dtype), list(t.shape)) for t in tensors]}


def unpack(packed: Packed, what: str) -> list[torch.Tensor]:
    """Inverse of :func:`pack`: views of the received frame (copied only when it is read-only).
    :class:`SyncError`, naming ``what`` was sent, when a dtype is not torch's or the bytes do not
    hold exactly the tensors listed."""
    data = _tensor(packed["data"])
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise SyncError(f"{what}: packed tensors must be bytes (uint8, 1-D), found {data.dtype} "
                        f"{tuple(data.shape)}")
    tensors: list[torch.Tensor] = []
    offset = 0
    for name, shape in packed["tensors"]:
        dtype = _torch_dtype(name, what)
        if not all(isinstance(n, int) and n >= 0 for n in shape):
            raise SyncError(f"{what}: {list(shape)} is not a shape (sizes >= 0)")
        size = math.prod(shape) * dtype.itemsize
        if offset + size > data.numel():
            raise SyncError(f"{what}: {len(packed['tensors'])} tensors of shapes "
                            f"{[list(s) for _, s in packed['tensors']]} need more than the "
                            f"{data.numel()} bytes sent")
        tensors.append(data[offset:offset + size].view(dtype).reshape(shape))
        offset += _padded(size)
    if offset != data.numel():
        raise SyncError(f"{what}: {data.numel()} bytes sent for {len(tensors)} tensors of "
                        f"{offset} bytes")
    return tensors


_INT32_ROWS = 2**31
"""Row ids below this travel as int32."""


def _ids_array(ids: torch.Tensor) -> Any:
    """Row ids ``(k,)`` int64, increasing, as int32 when the last one fits."""
    if ids.numel() and int(ids[-1]) >= _INT32_ROWS:
        return _array(ids)
    return _array(ids.to(torch.int32))


def _ids_tensor(value: Any) -> torch.Tensor:
    """Inverse of :func:`_ids_array`: int64 ids (anything else is left for the receiver's
    checks to name)."""
    ids = _tensor(value)
    return ids.to(torch.int64) if ids.dtype == torch.int32 else ids


def mask_to_bits(mask: torch.Tensor) -> np.ndarray:
    """A ``(rows,)`` bool mask as ``ceil(rows / 8)`` bytes of bits."""
    return np.packbits(mask.cpu().numpy())


def bits_to_mask(bits: Any, rows: int) -> torch.Tensor:
    """Inverse of :func:`mask_to_bits` for a mask of ``rows`` rows; :class:`SyncError` when
    ``bits`` are not ``ceil(rows / 8)`` bytes."""
    array = np.asarray(bits)
    if array.dtype != np.uint8 or array.shape != ((rows + 7) // 8,):
        raise SyncError(f"changed rows must be {(rows + 7) // 8} bytes of bits for {rows} rows, "
                        f"found {array.dtype} {array.shape}")
    return torch.from_numpy(np.unpackbits(array, count=rows).astype(bool))


def _entries_to_msg(entries: Sequence[LogEntry]) -> list[EntryMsg]:
    """Entries' tensors as numpy arrays, each sent as its own serialized frame."""
    out: list[EntryMsg] = []
    for e in entries:
        deltas, dtype = _typed_array(e.deltas)
        out.append({"seq": e.seq, "rows_offset": e.rows_offset, "ids": _ids_array(e.ids),
                    "deltas": deltas, "dtype": dtype})
    return out


def _msg_to_entries(msgs: Sequence[EntryMsg]) -> list[LogEntry]:
    """Inverse of :func:`_entries_to_msg`."""
    return [LogEntry(int(e["seq"]), _ids_tensor(e["ids"]), _typed_tensor(e["deltas"], e["dtype"]),
                     int(e["rows_offset"])) for e in msgs]


def payload_to_msg(payload: PeerPayload) -> PullMsg:
    """Entries' tensors become numpy arrays, each sent as its own serialized frame; the dense
    snapshot is packed into one."""
    dense = None if payload.dense is None else pack(payload.dense)
    return {"source": payload.source, "entries": _entries_to_msg(payload.entries),
            "dense": dense, "layout": payload.layout, "confirmed": payload.confirmed}


def msg_to_payload(msg: PullMsg) -> PeerPayload:
    """Inverse of :func:`payload_to_msg` on the receiving side."""
    dense = None if msg["dense"] is None else unpack(msg["dense"], "dense snapshot")
    return PeerPayload(msg["source"], _msg_to_entries(msg["entries"]), dense, msg["layout"],
                       int(msg["confirmed"]))


def snapshot_to_msg(snapshot: ReplicaSnapshot) -> SnapshotMsg:
    """Tables become numpy arrays, each sent as its own serialized frame; the dense parameters
    are packed into one."""
    return {"source": snapshot.source,
            "dense": pack(snapshot.dense),
            "tables": {name: _array(t) for name, t in snapshot.tables.items()},
            "applied": dict(snapshot.applied),
            "changed": to_serialize(mask_to_bits(snapshot.changed)),
            "kept": {source: _entries_to_msg(entries) for source, entries in snapshot.kept.items()},
            "confirmed": dict(snapshot.confirmed)}


def msg_to_snapshot(msg: SnapshotMsg) -> ReplicaSnapshot:
    """Inverse of :func:`snapshot_to_msg` on the receiving side."""
    tables = {name: _tensor(t) for name, t in msg["tables"].items()}
    rows = sum(t.shape[0] for t in tables.values())
    return ReplicaSnapshot(msg["source"], unpack(msg["dense"], "dense parameters"), tables,
                           {source: int(seq) for source, seq in msg["applied"].items()},
                           bits_to_mask(msg["changed"], rows),
                           {source: _msg_to_entries(entries)
                            for source, entries in msg["kept"].items()},
                           {source: int(offset) for source, offset in msg["confirmed"].items()})


def rows_to_msg(rows: LeaderRows) -> RowsMsg:
    """Ids and rows become numpy arrays, each sent as its own serialized frame; the dense
    parameters are packed into one."""
    return {"source": rows.source, "ids": _ids_array(rows.ids), "rows": _array(rows.rows),
            "dense": pack(rows.dense), "applied": dict(rows.applied)}


def msg_to_rows(msg: RowsMsg) -> LeaderRows:
    """Inverse of :func:`rows_to_msg` on the receiving side."""
    return LeaderRows(msg["source"], _ids_tensor(msg["ids"]), _tensor(msg["rows"]),
                      unpack(msg["dense"], "dense parameters"),
                      {source: int(seq) for source, seq in msg["applied"].items()})


def group_msg(answer: Answer, members_version: int) -> GroupMsg:
    group = answer.group
    return {"kind": answer.kind, "round": None if group is None else group.round,
            "members": [] if group is None else list(group.members),
            "final": False if group is None else group.final,
            "members_version": members_version}
