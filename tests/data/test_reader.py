"""The reader: a hand-written Parquet file read back as ``Batch``es, value by value."""

from __future__ import annotations

import math
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchrec.datasets.utils import Batch

from antdt.errors import DataError
from data.hashing import hash_ints, hash_strings
from data.reader import ShardReader, concat, table_batch
from data.schema import Schema

SCHEMA = Schema.from_dict({
    "label": "label",
    "dense": ["I1", "I2"],
    "sparse": [
        {"name": "C1", "num_embeddings": 1000},
        {"name": "S", "num_embeddings": 50, "type": "string"},
        {"name": "T", "num_embeddings": 100, "multi_valued": True},
        {"name": "U", "num_embeddings": 30, "type": "string", "multi_valued": True},
    ],
})

TABLE = pa.table({
    "label": pa.array([1, 0, 0, 1, 0], type=pa.int8()),
    "I1": [0.0, math.e - 1, -5.0, float("nan"), 2.5],
    "I2": pa.array([None, 3, 1, 20_000, 0], type=pa.int64()),
    "C1": pa.array([42, None, 42, 7, -1], type=pa.int64()),
    "S": pa.array(["a", None, "a", "b", ""]),
    "T": pa.array([[7, 9], [], None, [None, 3], [1]], type=pa.list_(pa.int64())),
    "U": pa.array([["x"], None, [], ["y", "x"], ["z"]], type=pa.list_(pa.string())),
    "unused": ["p", "q", "r", "s", "t"],
})


def h(values: list[int], n: int) -> list[int]:
    return hash_ints(np.array(values), n).tolist()


def s(values: list[str], n: int) -> list[int]:
    return hash_strings(values, n).tolist()


# Row by row, what the reader must produce for TABLE: (dense, label, {key: bag}).
EXPECTED_DENSE = [[0.0, 0.0], [1.0, math.log1p(3)], [0.0, math.log1p(1)],
                  [0.0, math.log1p(20_000)], [math.log1p(2.5), 0.0]]
EXPECTED_BAGS = {
    "C1": [h([42], 1000), [0], h([42], 1000), h([7], 1000), h([-1], 1000)],
    "S": [s(["a"], 50), [0], s(["a"], 50), s(["b"], 50), s([""], 50)],
    "T": [h([7, 9], 100), [0], [0], [0, *h([3], 100)], h([1], 100)],
    "U": [s(["x"], 30), [0], [0], s(["y", "x"], 30), s(["z"], 30)],
}


@pytest.fixture
def path(tmp_path: Path) -> str:
    """TABLE in row groups of 3 and 2 rows."""
    target = str(tmp_path / "part-00000.parquet")
    pq.write_table(TABLE, target, row_group_size=3)
    return target


def bags(batch: Batch) -> dict[str, list[list[int]]]:
    """Per key, the list of ids of each row."""
    result: dict[str, list[list[int]]] = {}
    for key, jagged in batch.sparse_features.to_dict().items():
        values = jagged.values().tolist()
        offsets = jagged.offsets().tolist()
        result[key] = [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    return result


def check_rows(batch: Batch, rows: range) -> None:
    assert batch.dense_features.dtype == torch.float32 and batch.labels.dtype == torch.float32
    assert batch.dense_features.shape == (len(rows), 2)
    expected_dense = torch.tensor([EXPECTED_DENSE[r] for r in rows])
    assert torch.allclose(batch.dense_features, expected_dense, atol=1e-6)
    assert batch.labels.tolist() == [float(TABLE.column("label")[r].as_py()) for r in rows]
    assert batch.sparse_features.keys() == ["C1", "S", "T", "U"]
    assert batch.sparse_features.stride() == len(rows)
    assert bags(batch) == {k: [v[r] for r in rows] for k, v in EXPECTED_BAGS.items()}


def test_whole_row_groups(path: str) -> None:
    reader = ShardReader(SCHEMA)
    check_rows(reader.read(path, 0, 0, 3), range(0, 3))
    check_rows(reader.read(path, 1, 0, 2), range(3, 5))


def test_kjt_layout_is_key_major(path: str) -> None:
    kjt = ShardReader(SCHEMA).read(path, 0, 0, 3).sparse_features
    assert kjt.lengths().tolist() == [1, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1]
    assert kjt.lengths().dtype == torch.int32 and kjt.values().dtype == torch.int64
    flat = [i for key in ("C1", "S", "T", "U") for row in EXPECTED_BAGS[key][:3] for i in row]
    assert kjt.values().tolist() == flat
    assert kjt.length_per_key() == [3, 3, 4, 3]


def test_row_ranges_are_relative_to_the_row_group(path: str) -> None:
    reader = ShardReader(SCHEMA)
    check_rows(reader.read(path, 0, 1, 3), range(1, 3))
    check_rows(reader.read(path, 1, 1, 2), range(4, 5))
    check_rows(reader.read(path, 0, 2, 3), range(2, 3))


def test_batches_cover_the_range_in_order(path: str) -> None:
    reader = ShardReader(SCHEMA)
    batches = list(reader.batches(path, 0, 0, 3, batch_size=2))
    assert [len(b.labels) for b in batches] == [2, 1]
    check_rows(batches[0], range(0, 2))
    check_rows(batches[1], range(2, 3))
    assert [len(b.labels) for b in reader.batches(path, 1, 1, 2, batch_size=5)] == [1]
    assert list(reader.batches(path, 1, 1, 1, batch_size=5)) == []
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        list(reader.batches(path, 0, 0, 3, batch_size=0))


def test_batches_of_two_row_groups_concatenate_into_their_rows_in_order(path: str) -> None:
    """A sync step can end one lease and begin the next: rows 1-2 of the first row group and
    rows 3-4 (the second's) read as one batch, with every key's bags in row order."""
    reader = ShardReader(SCHEMA)
    joined = concat([reader.read(path, 0, 1, 3), reader.read(path, 1, 0, 2)])
    check_rows(joined, range(1, 5))
    assert joined.sparse_features.length_per_key() == [4, 4, 5, 5]
    assert concat([reader.read(path, 0, 0, 3)]).labels.tolist() == [1.0, 0.0, 0.0]


def test_row_groups_are_decoded_once_while_cached(path: str) -> None:
    reader = ShardReader(SCHEMA, cache_row_groups=2)
    for start in range(3):
        reader.read(path, 0, start, start + 1)
    assert reader.decoded_row_groups == 1
    reader.read(path, 1, 0, 1)
    reader.read(path, 0, 0, 1)
    assert reader.decoded_row_groups == 2
    small = ShardReader(SCHEMA, cache_row_groups=1)
    for group in (0, 1, 0):
        small.read(path, group, 0, 1)
    assert small.decoded_row_groups == 3


def test_batches_do_not_share_memory_with_the_cache(path: str) -> None:
    reader = ShardReader(SCHEMA)
    first = reader.read(path, 0, 0, 3)
    first.dense_features.fill_(-1.0)
    first.labels.fill_(-1.0)
    first.sparse_features.values().fill_(-1)
    check_rows(reader.read(path, 0, 0, 3), range(0, 3))


def test_whole_group_batches_of_a_single_valued_schema_are_copies(tmp_path: Path) -> None:
    schema = Schema.from_dict({"label": "label", "dense": ["I1"],
                               "sparse": [{"name": "C1", "num_embeddings": 1000}]})
    target = str(tmp_path / "p.parquet")
    pq.write_table(TABLE, target)
    reader = ShardReader(schema)
    first = reader.read(target, 0, 0, 5)
    expected = first.sparse_features.values().clone(), first.dense_features.clone()
    first.sparse_features.values().fill_(-1)
    first.dense_features.fill_(-1.0)
    again = reader.read(target, 0, 0, 5)
    assert reader.decoded_row_groups == 1
    assert torch.equal(again.sparse_features.values(), expected[0])
    assert torch.equal(again.dense_features, expected[1])


def test_integer_counts_outside_the_log1p_table(tmp_path: Path) -> None:
    counts = [-(2**40), -1, 0, 16_383, 16_384, 2**40, None]
    schema = Schema.from_dict({"label": "y", "dense": ["x"],
                               "sparse": [{"name": "c", "num_embeddings": 10}]})
    table = pa.table({"y": [0] * 7, "x": pa.array(counts, type=pa.int64()), "c": [1] * 7})
    expected = [np.float32(math.log1p(max(c, 0))) if c is not None else 0.0 for c in counts]
    for part, rows in ((table, expected), (table.slice(2), expected[2:])):
        assert table_batch(part, schema).dense_features[:, 0].tolist() == rows


def test_an_evicted_row_group_lends_its_arrays_without_touching_old_batches(
        tmp_path: Path) -> None:
    target = str(tmp_path / "twice.parquet")
    reversed_rows = TABLE.take([4, 3, 2, 1, 0])
    pq.write_table(pa.concat_tables([TABLE, reversed_rows]), target, row_group_size=5)
    reader = ShardReader(SCHEMA, cache_row_groups=1)
    first = reader.read(target, 0, 0, 5)
    second = reader.read(target, 1, 0, 5)
    check_rows(first, range(0, 5))
    check_rows(second, range(4, -1, -1))
    check_rows(reader.read(target, 0, 0, 5), range(0, 5))
    assert reader.decoded_row_groups == 3


def test_one_file_stays_open_until_the_next_or_close(path: str, tmp_path: Path) -> None:
    other = str(tmp_path / "other.parquet")
    pq.write_table(TABLE, other)
    with ShardReader(SCHEMA, cache_row_groups=1) as reader:
        check_rows(reader.read(path, 0, 0, 3), range(0, 3))
        check_rows(reader.read(path, 1, 0, 2), range(3, 5))
        check_rows(reader.read(other, 0, 0, 5), range(0, 5))
        check_rows(reader.read(path, 0, 0, 3), range(0, 3))
    check_rows(reader.read(path, 1, 0, 2), range(3, 5))  # reopened after close()
    assert reader.decoded_row_groups == 5


def test_one_thread_and_many_threads_agree(path: str) -> None:
    with ShardReader(SCHEMA, threads=1) as serial, ShardReader(SCHEMA, threads=4) as parallel:
        a, b = serial.read(path, 0, 0, 3), parallel.read(path, 0, 0, 3)
    assert torch.equal(a.dense_features, b.dense_features)
    assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())


def test_single_valued_only_schema_and_dictionary_strings(tmp_path: Path) -> None:
    schema = Schema.from_dict({"label": "y", "dense": ["x"],
                               "sparse": [{"name": "c", "num_embeddings": 10},
                                          {"name": "d", "num_embeddings": 20, "type": "string"}]})
    target = str(tmp_path / "p.parquet")
    pq.write_table(pa.table({"y": [True, False], "x": pa.array([1, None], type=pa.int32()),
                             "c": pa.array([5, 6], type=pa.int16()),
                             "d": pa.array(["u", None]).dictionary_encode()}), target)
    batch = ShardReader(schema).read(target, 0, 0, 2)
    assert batch.labels.tolist() == [1.0, 0.0]
    assert batch.dense_features.tolist() == [[pytest.approx(math.log1p(1))], [0.0]]
    assert batch.sparse_features.values().tolist() == [*h([5, 6], 10), *s(["u"], 20), 0]
    assert batch.sparse_features.lengths().tolist() == [1, 1, 1, 1]


def test_reads_fsspec_urls() -> None:
    fs = fsspec.filesystem("memory")
    with fs.open("/reader-test/part.parquet", "wb") as fh:
        pq.write_table(TABLE, fh, row_group_size=3)
    try:
        check_rows(ShardReader(SCHEMA).read("memory:///reader-test/part.parquet", 1, 0, 2),
                   range(3, 5))
    finally:
        fs.rm("/reader-test", recursive=True)


def broken(tmp_path: Path, **columns: pa.Array) -> str:
    target = str(tmp_path / "broken.parquet")
    table = TABLE
    for name, column in columns.items():
        if column is None:
            table = table.drop_columns([name])
        else:
            table = table.set_column(table.schema.get_field_index(name), name, column)
    pq.write_table(table, target, row_group_size=3)
    return target


@pytest.mark.parametrize("columns, message", [
    ({"C1": pa.array(["1", "2", "3", "4", "5"])},
     "row group 1 column 'C1': expected an integer type (sparse int feature), found string"),
    ({"S": pa.array([1, 2, 3, 4, 5])},
     "row group 1 column 'S': expected a string type (sparse string feature), found int64"),
    ({"T": pa.array([1, 2, 3, 4, 5])},
     "row group 1 column 'T': expected a list of integers (multi-valued sparse int feature), "
     "found int64"),
    ({"I2": pa.array(["a", "b", "c", "d", "e"])},
     "row group 1 column 'I2': expected an integer or floating type (dense feature), found string"),
    ({"C1": None}, "row group 1 column 'C1': expected by the schema, found no such column"),
    ({"label": pa.array([1, None, 0, 1, 0])},
     "row group 0 column 'label': expected 0/1 labels, found 1 null(s)"),
])
def test_schema_mismatch_names_file_row_group_column(tmp_path: Path, columns: dict[str, pa.Array],
                                                     message: str) -> None:
    target = broken(tmp_path, **columns)
    group = int(message.split()[2])
    with pytest.raises(DataError) as info:
        ShardReader(SCHEMA).read(target, group, 0, 1)
    assert str(info.value).startswith(f"{target} {message}")


def test_table_batch_converts_an_in_memory_table_the_same_way() -> None:
    check_rows(table_batch(TABLE, SCHEMA), range(0, 5))
    check_rows(table_batch(TABLE.slice(3), SCHEMA), range(3, 5))
    as_floats = TABLE.set_column(2, "I2", TABLE.column("I2").cast(pa.float64()))  # as pandas does
    check_rows(table_batch(as_floats, SCHEMA), range(0, 5))
    with pytest.raises(DataError, match="^model input column 'C1': expected an integer type"):
        table_batch(TABLE.set_column(3, "C1", pa.array(["x"] * 5)), SCHEMA, where="model input")
    with pytest.raises(DataError, match="^model input column 'label': expected 0/1 labels, "
                                        "found 1 null"):
        table_batch(TABLE.set_column(0, "label", pa.array([1, None, 0, 1, 0])), SCHEMA,
                    where="model input")


def test_bad_ranges(path: str) -> None:
    reader = ShardReader(SCHEMA)
    for start, stop in ((0, 4), (2, 2), (-1, 1), (3, 1)):
        with pytest.raises(DataError, match=rf"row group 0: row range \[{start}, {stop}\) is not "
                                            r"inside the row group's 3 rows"):
            reader.read(path, 0, start, stop)
    with pytest.raises(DataError, match=r"row group 2 does not exist \(expected 0 <= row group "
                                        r"< 2\)"):
        reader.read(path, 2, 0, 1)
    with pytest.raises(ValueError, match="cache_row_groups must be >= 1"):
        ShardReader(SCHEMA, cache_row_groups=0)
