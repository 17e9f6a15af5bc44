"""Validation of deliberately broken files: each problem names file, row group, column and value."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from antdt.errors import DataError
from data.schema import Schema
from data.validate import Problem, validate

SCHEMA = Schema.from_dict({"label": "label", "dense": ["I1"],
                           "sparse": [{"name": "C1", "num_embeddings": 100},
                                      {"name": "S", "num_embeddings": 10, "type": "string"},
                                      {"name": "M", "num_embeddings": 10, "multi_valued": True}]})
ROWS = 100
GROUP = 40  # row groups of 40, 40 and 20 rows


def table(**columns: pa.Array | None) -> pa.Table:
    base = {"label": pa.array(np.arange(ROWS) % 2),
            "I1": pa.array(np.arange(ROWS, dtype=np.float32)),
            "C1": pa.array(np.arange(ROWS)),
            "S": pa.array([f"s{i % 7}" for i in range(ROWS)]),
            "M": pa.array([[i, i + 1] for i in range(ROWS)]),
            "extra": pa.array(["x"] * ROWS)}
    base.update(columns)
    return pa.table({k: v for k, v in base.items() if v is not None})


def write(directory: Path, name: str, data: pa.Table) -> str:
    path = str(directory / name)
    pq.write_table(data, path, row_group_size=GROUP)
    return path


def test_good_files_pass(tmp_path: Path) -> None:
    paths = [write(tmp_path, f"part-0000{i}.parquet", table()) for i in range(2)]
    dictionary = write(tmp_path, "dict.parquet", table(S=table().column("S").dictionary_encode(),
                                                       label=pa.array([True, False] * 50)))
    report = validate([*paths, dictionary], SCHEMA)
    assert report.ok and report.problems == []
    assert (report.good_rows, report.bad_rows, report.files) == (3 * ROWS, 0, 3)
    assert report.bad_units() == []
    report.raise_if_bad()


def test_label_values_name_row_group_value_and_count(tmp_path: Path) -> None:
    labels = np.arange(ROWS) % 2
    labels[40:57] = 2  # 17 rows of row group 1
    labels[85] = -1  # row group 2
    good = write(tmp_path, "part-00000.parquet", table())
    bad = write(tmp_path, "part-00003.parquet", table(label=pa.array(labels)))
    report = validate([good, bad], SCHEMA)
    assert report.problems == [
        Problem(bad, 1, "label", "expected 0/1, found 2 (17 rows)"),
        Problem(bad, 2, "label", "expected 0/1, found -1 (1 row)"),
    ]
    assert str(report.problems[0]) == \
        f"{bad} row group 1 column 'label': expected 0/1, found 2 (17 rows)"
    assert (report.good_rows, report.bad_rows) == (ROWS + GROUP, GROUP + 20)
    assert report.bad_units() == [(bad, 1, "expected 0/1, found 2 (17 rows)"),
                                  (bad, 2, "expected 0/1, found -1 (1 row)")]
    with pytest.raises(DataError) as info:
        report.raise_if_bad()
    message = str(info.value)
    assert message.startswith("2 data problem(s) in 2 file(s), 60 row(s) unusable:")
    assert f"{bad} row group 1 column 'label': expected 0/1, found 2 (17 rows)" in message
    assert f"{bad} row group 2 column 'label': expected 0/1, found -1 (1 row)" in message


def test_null_and_fractional_labels(tmp_path: Path) -> None:
    labels = (np.arange(ROWS) % 2).astype(float)
    labels[3], labels[4], labels[5] = 0.5, 7.0, 0.5
    values = labels.tolist()
    values[6] = None
    path = write(tmp_path, "p.parquet", table(label=pa.array(values)))
    report = validate([path], SCHEMA)
    assert report.problems == [
        Problem(path, 0, "label", "expected 0/1, found 0.5, 7.0 (3 rows) and null (1 row)")]


@pytest.mark.parametrize("columns, column, message", [
    ({"C1": pa.array([str(i) for i in range(ROWS)])}, "C1",
     "expected an integer type (sparse int feature), found string"),
    ({"C1": pa.array(np.arange(ROWS, dtype=np.float64))}, "C1",
     "expected an integer type (sparse int feature), found double"),
    ({"S": pa.array(np.arange(ROWS))}, "S",
     "expected a string type (sparse string feature), found int64"),
    ({"M": pa.array(np.arange(ROWS))}, "M",
     "expected a list of integers (multi-valued sparse int feature), found int64"),
    ({"M": pa.array([["a"]] * ROWS)}, "M",
     "expected a list of integers (multi-valued sparse int feature), found list<element: string>"),
    ({"I1": pa.array(["x"] * ROWS)}, "I1",
     "expected an integer or floating type (dense feature), found string"),
    ({"label": pa.array(["1"] * ROWS)}, "label",
     "expected an integer, floating or bool type (label), found string"),
])
def test_wrong_column_type_marks_the_whole_file(tmp_path: Path, columns: dict[str, pa.Array],
                                                column: str, message: str) -> None:
    path = write(tmp_path, "part-00001.parquet", table(**columns))
    report = validate([path], SCHEMA)
    assert report.problems == [Problem(path, None, column, message)]
    assert str(report.problems[0]) == f"{path} column {column!r}: {message}"
    assert (report.good_rows, report.bad_rows) == (0, ROWS)
    assert report.bad_units() == [(path, None, message)]


def test_missing_columns_are_each_reported(tmp_path: Path) -> None:
    path = write(tmp_path, "part-00002.parquet", table(C1=None, I1=None))
    report = validate([path], SCHEMA)
    assert [(p.row_group, p.column) for p in report.problems] == [(None, "I1"), (None, "C1")]
    assert report.problems[0].message.startswith(
        "expected by the schema, found no such column (the file has ['label', 'S', 'M', 'extra'])")
    assert len(report.bad_units()) == 1
    assert "; " in report.bad_units()[0][2]


def test_truncated_file(tmp_path: Path) -> None:
    good = write(tmp_path, "part-00000.parquet", table())
    truncated = tmp_path / "part-00001.parquet"
    truncated.write_bytes(Path(good).read_bytes()[: -100])
    report = validate([good, str(truncated)], SCHEMA)
    assert len(report.problems) == 1
    problem = report.problems[0]
    assert (problem.path, problem.row_group, problem.column) == (str(truncated), None, None)
    assert problem.message.startswith("cannot read the Parquet footer (")
    assert problem.message.endswith("); expected a complete Parquet file")
    assert (report.good_rows, report.bad_rows) == (ROWS, 0)


def test_corrupt_row_group(tmp_path: Path) -> None:
    path = write(tmp_path, "part-00004.parquet", table())
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(2)  # C1 of row group 1
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(Path(path).read_bytes())
    data[start + 20:start + chunk.total_compressed_size - 5] = \
        b"\xab" * (chunk.total_compressed_size - 25)
    Path(path).write_bytes(bytes(data))
    report = validate([path], SCHEMA)
    assert [(p.row_group, p.column) for p in report.problems] == [(1, None)]
    assert report.problems[0].message.startswith("cannot read the row group (")
    assert (report.good_rows, report.bad_rows) == (GROUP + 20, GROUP)
