"""`antdt bench data`: our reader (Parquet row range -> Batch) against bare pyarrow.

Both sides read the same row groups of the same files from the page cache; the baseline stops at
numpy arrays (``read_row_group`` + ``to_numpy``), ours goes on to hashed ids, the dense
transform and a ``KeyedJaggedTensor``. Repeats are interleaved so machine noise hits both.
"""

from __future__ import annotations

import tempfile
import time

import click
import pyarrow.parquet as pq

from data.files import RowGroup, expand, row_groups
from data.reader import ShardReader
from data.schema import Schema
from data.synth import generate
from pipeline.bench import emit, median_of


def pyarrow_pass(groups: list[RowGroup], columns: list[str]) -> float:
    """Rows/s of bare pyarrow: decode each row group and convert every column to numpy."""
    start = time.perf_counter()
    for group in groups:
        table = pq.ParquetFile(group.path).read_row_group(group.index, columns=columns)
        for column in table.columns:
            column.to_numpy()
    return sum(g.num_rows for g in groups) / (time.perf_counter() - start)


def reader_pass(groups: list[RowGroup], schema: Schema, batch_size: int) -> float:
    """Rows/s of a fresh :class:`ShardReader` turning every row into ``Batch``es."""
    reader = ShardReader(schema)
    start = time.perf_counter()
    for group in groups:
        for _ in reader.batches(group.path, group.index, 0, group.num_rows, batch_size):
            pass
    return sum(g.num_rows for g in groups) / (time.perf_counter() - start)


@click.command("data")
@click.option("--rows", type=click.IntRange(min=1), default=524_288, show_default=True)
@click.option("--row-group-rows", type=click.IntRange(min=1), default=65_536, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def command(rows: int, row_group_rows: int, batch_size: int, repeats: int, as_json: bool) -> None:
    """Reader throughput versus bare pyarrow on the same row groups (target ratio >= 0.7)."""
    with tempfile.TemporaryDirectory(prefix="antdt-bench-data-") as tmp:
        result = generate(tmp, rows=rows, days=1, seed=0, row_group_rows=row_group_rows,
                          files_per_day=2)
        schema = result.schema
        groups = row_groups(expand(tmp))
        pyarrow_pass(groups, schema.columns)
        ours, baseline = [], []
        for _ in range(repeats):
            baseline.append(pyarrow_pass(groups, schema.columns))
            ours.append(reader_pass(groups, schema, batch_size))
        rows_per_s = median_of(ours)
        pyarrow_rows_per_s = median_of(baseline)
    emit({"rows_per_s": round(rows_per_s), "pyarrow_rows_per_s": round(pyarrow_rows_per_s),
          "ratio": round(rows_per_s / pyarrow_rows_per_s, 3), "rows": rows,
          "row_group_rows": row_group_rows, "batch_size": batch_size, "repeats": repeats}, as_json)
