"""The sync's messages on Dask comms: payloads, snapshots and leader rows arrive as sent, bfloat16
deltas and int32 ids halve a payload, dense tensors travel as one frame."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from distributed.protocol import dumps, loads

from antdt.errors import SyncError
from antdt.sync import LeaderRows, LogEntry, PeerPayload, ReplicaSnapshot
from antdt.sync.wire import (bits_to_mask, mask_to_bits, msg_to_payload, msg_to_rows,
                             msg_to_snapshot, payload_to_msg, rows_to_msg, snapshot_to_msg)


def test_bfloat16_deltas_and_int32_ids_halve_a_payload_on_the_wire() -> None:
    """A payload of rounded deltas arrives as sent (bfloat16 travels as int16, named; ids as
    int32 and back to int64): 36 bytes a row of dim 16, against 68 with float32 deltas and 72
    when ids went as int64."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(650_000, generator=gen)[:35_000].sort().values
    deltas = torch.randn(len(ids), 16, generator=gen)
    sizes = {}
    for dtype in (torch.float32, torch.bfloat16):
        payload = PeerPayload("w", [LogEntry(1, ids, deltas.to(dtype), 9)], None, "t:650000x16")
        frames = dumps(payload_to_msg(payload))
        sizes[dtype] = sum(memoryview(f).nbytes for f in frames)
        entry = msg_to_payload(loads(frames)).entries[0]
        assert entry.ids.dtype == torch.int64 and torch.equal(entry.ids, ids)
        assert entry.deltas.dtype == dtype and torch.equal(entry.deltas, deltas.to(dtype))
    assert len(ids) * (4 + 16 * 4) <= sizes[torch.float32] < len(ids) * (8 + 16 * 4)  # int32 ids
    assert len(ids) * (4 + 16 * 2) <= sizes[torch.bfloat16] < 0.54 * sizes[torch.float32]
    wide = PeerPayload("w", [LogEntry(1, torch.tensor([2**31]), torch.ones(1, 2), 9)], None, "")
    assert msg_to_payload(loads(dumps(payload_to_msg(wide)))).entries[0].ids.tolist() == [2**31]
    msg = payload_to_msg(PeerPayload("w", [LogEntry(1, ids[:2], deltas[:2], 9)], None, ""))
    msg["entries"][0]["dtype"] = "bfloat16"  # float32 bytes named bfloat16: refused, not read
    with pytest.raises(SyncError, match="bfloat16 sent as torch.float32, expected torch.int16"):
        msg_to_payload(loads(dumps(msg)))


def test_payload_roundtrip_through_messages() -> None:
    payload = PeerPayload("w", [LogEntry(3, torch.tensor([1, 4]), torch.ones(2, 5), 9)],
                          [torch.arange(6.0).reshape(2, 3)], "t:8x5")
    back = msg_to_payload(loads(dumps(payload_to_msg(payload))))  # as a comm does
    assert back.source == "w" and back.entries[0].seq == 3 and back.entries[0].rows_offset == 9
    assert back.layout == "t:8x5"
    ids, deltas = back.entries[0].ids, back.entries[0].deltas
    assert ids.tolist() == [1, 4] and ids.dtype == torch.int64
    assert torch.equal(deltas, torch.ones(2, 5))
    assert back.dense is not None and torch.equal(back.dense[0], torch.arange(6.0).reshape(2, 3))
    snapshot = ReplicaSnapshot("w", [torch.ones(2)], {"t": torch.arange(6.0).reshape(3, 2)},
                               {"w": 4, "v": 2}, torch.tensor([True, False, True]))
    copy = msg_to_snapshot(loads(dumps(snapshot_to_msg(snapshot))))
    assert copy.source == "w" and copy.applied == {"w": 4, "v": 2}
    assert torch.equal(copy.tables["t"], snapshot.tables["t"])
    assert torch.equal(copy.dense[0], torch.ones(2))
    assert copy.changed.tolist() == [True, False, True]
    rows = LeaderRows("w", torch.tensor([0, 7]), torch.ones(2, 5), [torch.zeros(3)], {"w": 2})
    back_rows = msg_to_rows(loads(dumps(rows_to_msg(rows))))
    assert back_rows.ids.tolist() == [0, 7] and back_rows.ids.dtype == torch.int64
    assert torch.equal(back_rows.rows, rows.rows) and back_rows.applied == {"w": 2}
    assert torch.equal(back_rows.dense[0], torch.zeros(3)) and back_rows.nbytes == 16 + 40 + 12
    mask = torch.arange(21) % 3 == 0
    bits = mask_to_bits(mask)
    assert bits.nbytes == 3 and torch.equal(bits_to_mask(bits, 21), mask)
    with pytest.raises(SyncError, match=r"3 bytes of bits for 21 rows, found uint8 \(4,\)"):
        bits_to_mask(np.zeros(4, dtype=np.uint8), 21)


def test_a_dense_snapshot_travels_as_one_frame() -> None:
    """Dense tensors of any dtypes and shapes arrive as sent, as views of one frame: the frames
    of a pull do not grow with the number of dense parameters. A packing whose bytes do not hold
    the tensors it lists is refused, naming what was sent."""
    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(3, 5, generator=gen), torch.randn(7, generator=gen).to(torch.bfloat16),
             torch.tensor(2.5, dtype=torch.float64), torch.zeros(0, 4),
             torch.tensor([True, False, True]), torch.randn(4, 3, generator=gen).t()]
    frames = {}
    for count in (1, len(dense)):
        frames[count] = dumps(payload_to_msg(PeerPayload("w", [], dense[:count], "")))
        back = msg_to_payload(loads(frames[count])).dense
        assert back is not None and len(back) == count
        for got, sent in zip(back, dense):
            assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
    assert len(frames[1]) == len(frames[len(dense)])
    rows = LeaderRows("w", torch.tensor([0]), torch.ones(1, 2), dense, {"w": 1})
    assert all(torch.equal(a, b) for a, b in
               zip(msg_to_rows(loads(dumps(rows_to_msg(rows)))).dense, dense))
    msg = payload_to_msg(PeerPayload("w", [], dense[:2], ""))
    assert msg["dense"] is not None
    msg["dense"]["tensors"][1] = ("bfloat16", [9])
    with pytest.raises(SyncError, match=r"dense snapshot: 2 tensors of shapes \[\[3, 5\], \[9\]\] "
                                        "need more than the 80 bytes sent"):
        msg_to_payload(loads(dumps(msg)))
    msg["dense"]["tensors"][1] = ("bfloat16", [3])
    with pytest.raises(SyncError, match="dense snapshot: 80 bytes sent for 2 tensors of 72"):
        msg_to_payload(loads(dumps(msg)))
    msg["dense"]["tensors"][1] = ("bfloat16", [7, -1])
    with pytest.raises(SyncError, match=r"dense snapshot: \[7, -1\] is not a shape"):
        msg_to_payload(loads(dumps(msg)))
    msg["dense"]["tensors"][1] = ("no_such_dtype", [7])
    with pytest.raises(SyncError, match="dense snapshot: 'no_such_dtype' is not a torch dtype"):
        msg_to_payload(loads(dumps(msg)))
