"""A model in parts loads only as written: the files are checked against their manifest's sizes
and sha256, blocks of two groups' files that overlap are refused (their coverage could add up with
rows left unset), and a corrupt header is one clear line naming the file, never a MemoryError or a
KeyError (``models/shards.py``). The parts are written by :func:`write_rank` as the ranks write
them; the ranks themselves are in ``test_sharded.py``."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from models.shards import (DENSE, MAGIC, Block, ShardFiles, Table, rank_file, read_full_state,
                           write_dense, write_rank)

TABLE = Table("t", "tables.t.weight", (10, 4), ["t.weight.momentum"])
WEIGHTS = torch.arange(40, dtype=torch.float32).reshape(10, 4)
MOMENTUM = -torch.arange(10, dtype=torch.float32)


def write_group(folder: Path, cuts: list[int]) -> dict[str, dict[str, Any]]:
    """The table's rows cut at ``cuts`` (one rank each part), its weight and a row-wise state;
    the manifest's files (name: bytes and sha256)."""
    edges = [0, *cuts, TABLE.shape[0]]
    files = {}
    for rank, (low, high) in enumerate(zip(edges, edges[1:])):
        rows = (low, high - low)
        name, digest = write_rank(str(folder), rank, len(edges) - 1, [TABLE], [
            (Block(TABLE.key, None, rows, (0, 4)), WEIGHTS[low:high]),
            (Block(TABLE.key, "t.weight.momentum", rows, (0, 4)), MOMENTUM[low:high])])
        files[name] = digest
    name, digest = write_dense(str(folder), {"keys": [TABLE.key], "model": {},
                                             "dense_optimizer": {}, "sparse_iter": [],
                                             "rows_trained": 7})
    files[name] = digest
    return files


def one_line(error: pytest.ExceptionInfo[ValueError], path: Path) -> str:
    message = str(error.value)
    assert "\n" not in message and str(path) in message
    return message


def test_parts_as_written_read_back_whole(tmp_path: Path) -> None:
    files = write_group(tmp_path, [3, 6])
    state = read_full_state(str(tmp_path), files)
    assert torch.equal(state["model"][TABLE.key], WEIGHTS)
    assert torch.equal(state["sparse_optimizer"]["state"]["t.weight"]["t.weight.momentum"],
                       MOMENTUM)
    assert state["rows_trained"] == 7
    # a folder found on disk, its files named without digests (a warm start's): read unchecked
    assert torch.equal(read_full_state(str(tmp_path), {n: {} for n in files})["model"][TABLE.key],
                       WEIGHTS)


def test_a_part_whose_bytes_changed_is_refused_by_its_sha256(tmp_path: Path) -> None:
    files = write_group(tmp_path, [3, 6])
    part = tmp_path / rank_file(1, 3)
    data = bytearray(part.read_bytes())
    data[-13] ^= 0xFF  # the weight block's last byte (3 momentum floats follow): the header reads
    part.write_bytes(bytes(data))
    parts = ShardFiles(str(tmp_path), files)  # sizes match: the digest is checked on reading
    with pytest.raises(ValueError, match="sha256") as error:
        parts.fill(torch.empty(10, 4), TABLE, None, (0, 10), (0, 4))
    assert "expected " + files[rank_file(1, 3)]["sha256"] in one_line(error, part)
    # the rows of the files left intact still load: each file is checked where it is read
    rows = torch.empty(3, 4)
    parts.fill(rows, TABLE, None, (0, 3), (0, 4))
    assert torch.equal(rows, WEIGHTS[:3])
    # named without its digest, the corrupt value loads: the manifest is what catches it
    unchecked = torch.empty(10, 4)
    ShardFiles(str(tmp_path), list(files)).fill(unchecked, TABLE, None, (0, 10), (0, 4))
    assert not torch.equal(unchecked, WEIGHTS)


def test_a_part_of_another_size_or_a_corrupt_dense_part_is_refused(tmp_path: Path) -> None:
    files = write_group(tmp_path, [5])
    dense = tmp_path / DENSE
    data = bytearray(dense.read_bytes())
    data[len(data) // 2] ^= 0xFF
    dense.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256") as error:
        ShardFiles(str(tmp_path), files).dense()
    one_line(error, dense)
    dense.write_bytes(bytes(data[:100]))
    with pytest.raises(ValueError, match="100 bytes, expected") as error:
        ShardFiles(str(tmp_path), files)
    one_line(error, dense)
    with pytest.raises(ValueError, match="not a readable dense part") as error:
        ShardFiles(str(tmp_path), list(files)).dense()  # unchecked: still one line
    one_line(error, dense)


def test_files_of_two_groups_whose_blocks_overlap_are_refused(tmp_path: Path) -> None:
    """Rank 1 of another group of three: rows 4-6 where this group's rank 1 had 3-5. Row 3 is
    in no file and row 6 in two, so the rows counted add up to the table's 10; counted twice
    that way, the mixed files loaded with row 3 left unset."""
    write_group(tmp_path / "a", [3, 6])
    write_group(tmp_path / "b", [4, 7])
    shutil.copy(tmp_path / "b" / rank_file(1, 3), tmp_path / "a" / rank_file(1, 3))
    names = [rank_file(r, 3) for r in range(3)] + [DENSE]
    with pytest.raises(ValueError, match="overlaps") as error:
        read_full_state(str(tmp_path / "a"), names)
    assert "rows (6, 4)" in one_line(error, tmp_path / "a")


def test_rows_in_no_file_are_refused(tmp_path: Path) -> None:
    """This group's rank 0 (rows 0-2) with another group's ranks 1 and 2 (rows 4-9)."""
    write_group(tmp_path / "a", [3, 6])
    write_group(tmp_path / "b", [4, 7])
    for rank in (1, 2):
        shutil.copy(tmp_path / "b" / rank_file(rank, 3), tmp_path / "a" / rank_file(rank, 3))
    names = [rank_file(r, 3) for r in range(3)] + [DENSE]
    with pytest.raises(ValueError, match=r"do not cover rows \(0, 10\)") as error:
        read_full_state(str(tmp_path / "a"), names)
    one_line(error, tmp_path / "a")


def rewrite(path: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    """Rewrite the header of the rank file ``path`` as ``change`` leaves it (the data kept)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    header = json.loads(raw[start:start + length])
    change(header)
    new = json.dumps(header).encode()
    path.write_bytes(MAGIC + struct.pack("<Q", len(new)) + new + raw[start + length:])


def _set(*keys: Any, value: Any) -> Callable[[dict[str, Any]], Any]:
    def change(header: dict[str, Any]) -> None:
        where = header
        for key in keys[:-1]:
            where = where[key]
        if value is KeyError:
            del where[keys[-1]]
        else:
            where[keys[-1]] = value
    return change


@pytest.mark.parametrize("change, says", [
    (_set("blocks", value=KeyError), "'blocks' must be a list"),
    (_set("blocks", 0, "rows", value=[8, 5]), "'rows' must be [first, count] inside 0..10"),
    (_set("blocks", 0, "table", value="other"), "table 'other' is not one of its tables"),
    (_set("blocks", 0, "shape", value=[3, 5]), "does not fit rows"),
    (_set("blocks", 0, "dtype", value="int8"), "dtype 'int8' is not one of"),
    (_set("blocks", 1, "offset", value=10**12), "past the file's"),
    (_set("blocks", 1, "state", value="x"), "state 'x' is not one of"),
    (_set("tables", 0, "shape", value=[10, -4]), "'shape' must be two sizes"),
    (_set("tables", 0, "key", value=7), "table 0: 'key' must be a str"),
    (_set("rank", value=2), "it says rank 2 of 3"),
])
def test_a_corrupt_header_is_one_line_naming_the_file_and_the_field(
        tmp_path: Path, change: Callable[[dict[str, Any]], Any], says: str) -> None:
    files = write_group(tmp_path, [3, 6])
    part = tmp_path / rank_file(0, 3)
    rewrite(part, change)
    with pytest.raises(ValueError) as error:
        ShardFiles(str(tmp_path), list(files))
    message = one_line(error, part)
    assert "corrupt header" in message and says in message


@pytest.mark.parametrize("length, says", [(2**62, "it says it has"), (None, "not JSON")])
def test_a_header_length_past_the_file_or_garbled_is_refused(tmp_path: Path, length: int | None,
                                                             says: str) -> None:
    """A length of 2**62 was read as such (a MemoryError); a garbled header is not JSON."""
    files = write_group(tmp_path, [3, 6])
    part = tmp_path / rank_file(2, 3)
    raw = bytearray(part.read_bytes())
    if length is not None:
        raw[len(MAGIC):len(MAGIC) + 8] = struct.pack("<Q", length)
    else:
        raw[len(MAGIC) + 8] = ord("}")
    part.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=says) as error:
        ShardFiles(str(tmp_path), list(files))
    one_line(error, part)
