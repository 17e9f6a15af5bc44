"""Bad input made on purpose: real Parquet files rewritten with a value the schema refuses."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq


def break_label(path: str, row_group_rows: int) -> int:
    """Rewrite ``path`` (row groups of ``row_group_rows``) with label 2 in its sixth row, in
    its first row group; return its row count."""
    table = pq.read_table(path)
    labels = table.column("label").to_pylist()
    labels[5] = 2
    index = table.schema.get_field_index("label")
    table = table.set_column(index, "label", pa.array(labels, type=table.schema.field(index).type))
    pq.write_table(table, path, row_group_size=row_group_rows)
    return table.num_rows
