"""Checking Parquet files against a schema before training.

:func:`validate` opens every file, compares its columns with the schema, then decodes every row
group (the schema's columns) and checks, with ``pyarrow.compute``, that its label holds only 0/1
and no null. Everything it finds goes into a
:class:`ValidationReport` as :class:`Problem` records, each naming the file, the row group (None:
the whole file) and the column. The trainer either raises (``on_bad_data: fail``,
:meth:`ValidationReport.raise_if_bad`) or sets the bad units aside and reports their rows
(``quarantine``, :meth:`ValidationReport.bad_units`): rows are never dropped silently.

The column type rules (:func:`column_type_problem`) are shared with the reader, which checks them
again at read time (a file may change between validation and training).

    >>> import pyarrow as pa, pyarrow.parquet as pq, tempfile
    >>> from data.schema import Schema
    >>> schema = Schema.from_dict({"label": "y", "dense": ["x"],
    ...                            "sparse": [{"name": "c", "num_embeddings": 10}]})
    >>> path = tempfile.mkdtemp() + "/part-00000.parquet"
    >>> pq.write_table(pa.table({"y": [0, 1, 2, 2], "x": [1.0, 2.0, 3.0, 4.0], "c": [7, 8, 9, 7]}),
    ...                path, row_group_size=2)
    >>> report = validate([path], schema)
    >>> report.ok, report.good_rows, report.bad_rows
    (False, 2, 2)
    >>> [(p.row_group, p.column, p.message) for p in report.problems]
    [(1, 'y', 'expected 0/1, found 2 (2 rows)')]
    >>> pq.write_table(pa.table({"y": [0, 1], "x": [1.0, 2.0], "c": ["a", "b"]}), path)
    >>> [(p.row_group, p.column, p.message) for p in validate([path], schema).problems]
    [(None, 'c', 'expected an integer type (sparse int feature), found string')]
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from antdt.errors import DataError
from data.files import open_parquet
from data.schema import Schema, SparseFeature

logger = logging.getLogger(__name__)

_SHOWN_VALUES = 3


def _is_string(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):
        return _is_string(kind.value_type)
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _is_integer(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):
        return _is_integer(kind.value_type)
    return pa.types.is_integer(kind)


def _is_number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def _sparse_element_ok(feature: SparseFeature, kind: pa.DataType) -> bool:
    return _is_string(kind) if feature.type == "string" else _is_integer(kind)


def column_type_problem(schema: Schema, column: str, kind: pa.DataType) -> str | None:
    """Why ``column`` of Arrow type ``kind`` does not fit ``schema``, or None when it does.

    Label: integer, floating or bool. Dense: integer or floating. Sparse ``int``: integer;
    sparse ``string``: string, large_string or a dictionary of either; multi-valued: a list
    (or large list) of those.
    """
    if column == schema.label:
        if _is_number(kind) or pa.types.is_boolean(kind):
            return None
        return f"expected an integer, floating or bool type (label), found {kind}"
    if column in schema.dense:
        if _is_number(kind):
            return None
        return f"expected an integer or floating type (dense feature), found {kind}"
    feature = next(f for f in schema.sparse if f.name == column)
    if feature.multi_valued:
        if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) \
                and _sparse_element_ok(feature, kind.value_type):
            return None
        elements = "strings" if feature.type == "string" else "integers"
        return (f"expected a list of {elements} (multi-valued sparse {feature.type} feature), "
                f"found {kind}")
    if _sparse_element_ok(feature, kind):
        return None
    element = "a string type" if feature.type == "string" else "an integer type"
    return f"expected {element} (sparse {feature.type} feature), found {kind}"


def file_schema_problems(schema: Schema, arrow_schema: pa.Schema) -> list[tuple[str, str]]:
    """(column, message) for every schema column missing from or mistyped in ``arrow_schema``."""
    problems: list[tuple[str, str]] = []
    for column in schema.columns:
        index = arrow_schema.get_field_index(column)
        if index < 0:
            problems.append((column, f"expected by the schema, found no such column (the file "
                                     f"has {arrow_schema.names})"))
            continue
        why = column_type_problem(schema, column, arrow_schema.field(index).type)
        if why is not None:
            problems.append((column, why))
    return problems


class Problem(NamedTuple):
    """One thing wrong with the data; ``row_group`` None means the whole file is unusable."""

    path: str
    row_group: int | None
    column: str | None
    message: str

    def __str__(self) -> str:
        where = self.path
        if self.row_group is not None:
            where += f" row group {self.row_group}"
        if self.column is not None:
            where += f" column {self.column!r}"
        return f"{where}: {self.message}"


@dataclass
class ValidationReport:
    """What :func:`validate` found: problems, and rows in good and bad units."""

    problems: list[Problem] = field(default_factory=list)
    good_rows: int = 0
    bad_rows: int = 0
    files: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def bad_units(self) -> list[tuple[str, int | None, str]]:
        """(path, row group or None for the whole file, reason): one entry per unusable unit.

        A unit with several problems appears once, its reasons joined with ``"; "``.
        """
        reasons: dict[tuple[str, int | None], list[str]] = {}
        for problem in self.problems:
            reasons.setdefault((problem.path, problem.row_group), []).append(problem.message)
        return [(path, group, "; ".join(messages)) for (path, group), messages in reasons.items()]

    def raise_if_bad(self) -> None:
        """Raise a :class:`DataError` listing every problem, one per line; nothing when ok."""
        if self.problems:
            lines = "\n".join(f"  {p}" for p in self.problems)
            raise DataError(f"{len(self.problems)} data problem(s) in {self.files} file(s), "
                            f"{self.bad_rows} row(s) unusable:\n{lines}")


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def _label_problem(labels: pa.ChunkedArray) -> str | None:
    """Why a row group's label column is not all 0/1 and non-null, or None (vectorised).

    Names up to three of the offending values, e.g. ``expected 0/1, found 2 (17 rows)``.
    """
    found: list[str] = []
    if not pa.types.is_boolean(labels.type):
        bad = pc.and_(pc.not_equal(labels, 0), pc.not_equal(labels, 1))
        bad_count = pc.sum(pc.cast(bad, pa.int64())).as_py() or 0
        if bad_count:
            values = pc.unique(pc.filter(labels, bad)).to_pylist()
            shown = ", ".join(repr(v) for v in sorted(values)[:_SHOWN_VALUES])
            more = ", ..." if len(values) > _SHOWN_VALUES else ""
            found.append(f"{shown}{more} ({_rows(bad_count)})")
    if labels.null_count:
        found.append(f"null ({_rows(labels.null_count)})")
    return f"expected 0/1, found {' and '.join(found)}" if found else None


def _validate_file(path: str, schema: Schema, report: ValidationReport) -> None:
    with contextlib.ExitStack() as stack:
        try:
            parquet = stack.enter_context(open_parquet(path))
        except DataError as exc:
            report.problems.append(Problem(path, None, None, f"cannot read the Parquet footer "
                                           f"({exc.__cause__}); expected a complete Parquet file"))
            return
        mismatches = file_schema_problems(schema, parquet.schema_arrow)
        if mismatches:
            report.problems.extend(Problem(path, None, column, message)
                                   for column, message in mismatches)
            report.bad_rows += parquet.metadata.num_rows
            return
        for group in range(parquet.metadata.num_row_groups):
            _validate_row_group(parquet, path, group, schema, report)


def _validate_row_group(parquet: pq.ParquetFile, path: str, group: int, schema: Schema,
                        report: ValidationReport) -> None:
    rows = parquet.metadata.row_group(group).num_rows
    try:
        table = parquet.read_row_group(group, columns=schema.columns)
    except (OSError, pa.ArrowException) as exc:
        report.problems.append(Problem(path, group, None, f"cannot read the row group ({exc})"))
        report.bad_rows += rows
        return
    problem = _label_problem(table.column(schema.label))
    if problem is None:
        report.good_rows += rows
        return
    report.problems.append(Problem(path, group, schema.label, problem))
    report.bad_rows += rows


def validate(paths: Sequence[str], schema: Schema) -> ValidationReport:
    """Check every file of ``paths`` against ``schema``; never raises for bad data.

    Per file: the footer is readable and every schema column is present with a compatible type
    (else the whole file is bad: ``row_group`` None). Per row group: every schema column decodes
    and the label holds only 0/1, no null (else that row group is bad). Rows of bad units are
    counted in ``bad_rows``; a file whose footer cannot be read counts no rows (they are unknown).
    """
    report = ValidationReport(files=len(paths))
    for path in paths:
        _validate_file(path, schema, report)
    if report.ok:
        logger.info("validated %d file(s): %d rows, no problem", len(paths), report.good_rows)
    else:
        logger.warning("validated %d file(s): %d good rows, %d bad rows, %d problem(s)",
                       len(paths), report.good_rows, report.bad_rows, len(report.problems))
    return report
