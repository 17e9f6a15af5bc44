"""Finding Parquet files and their row groups.

:func:`expand` turns what a user writes in a job config (paths, directories, globs, fsspec URLs)
into a sorted list of files; :func:`row_groups` lists each file's row groups from the Parquet
footers alone, which is what the sharding service splits into shards.

    >>> import pyarrow as pa, pyarrow.parquet as pq, tempfile, os
    >>> root = tempfile.mkdtemp()
    >>> os.makedirs(f"{root}/date=2026-11-01")
    >>> pq.write_table(pa.table({"x": range(10)}), f"{root}/date=2026-11-01/part-00000.parquet",
    ...                row_group_size=4)
    >>> [os.path.relpath(p, root) for p in expand(root)]
    ['date=2026-11-01/part-00000.parquet']
    >>> [(g.index, g.num_rows) for g in row_groups(expand(f"{root}/date=2026-11-0[1-5]"))]
    [(0, 4), (1, 4), (2, 2)]
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, NamedTuple, Sequence

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from antdt.errors import DataError

logger = logging.getLogger(__name__)

PARQUET_SUFFIX = ".parquet"
_GLOB_CHARS = frozenset("*?[")


class RowGroup(NamedTuple):
    """One row group of one Parquet file: the unit the sharding service splits into shards."""

    path: str
    index: int  # type: ignore[assignment]  # the row group's index; shadows tuple.index
    num_rows: int


def _is_url(spec: str) -> bool:
    return "://" in spec


def _expand_one(spec: str) -> list[str]:
    """The files one spec names (a file, a directory, a glob), as the spec spells paths."""
    fs, root = url_to_fs(spec)
    if any(c in root for c in _GLOB_CHARS):
        matched: list[str] = []
        for path in fs.glob(root):
            if fs.isdir(path):
                matched.extend(_parquet_under(fs, path))
            elif path.endswith(PARQUET_SUFFIX):
                matched.append(path)
    elif fs.isdir(root):
        matched = _parquet_under(fs, root)
    elif fs.isfile(root):
        matched = [root]
    else:
        matched = []
    return [fs.unstrip_protocol(p) for p in matched] if _is_url(spec) else matched


def _parquet_under(fs: fsspec.AbstractFileSystem, directory: str) -> list[str]:
    return [p for p in fs.find(directory) if p.endswith(PARQUET_SUFFIX)]


def expand(spec: str | Sequence[str]) -> list[str]:
    """Every Parquet file named by ``spec``: sorted, without duplicates.

    Each entry may be a file (taken whatever its name), a directory (every ``*.parquet`` below
    it, recursively), or a glob (``data/date=2026-11-0[1-5]``, ``data/**/*.parquet``) whose
    matched directories are expanded like directories and whose matched files are kept when
    they end in ``.parquet``. Entries may be fsspec URLs (``file://``, ``memory://``, ...); the
    files of a URL entry are returned as URLs of the same protocol, those of a plain path as
    absolute local paths. An entry that matches no file raises :class:`DataError`.
    """
    specs = [spec] if isinstance(spec, str) else list(spec)
    if not specs:
        raise DataError("no data paths given: expected at least one file, directory or glob")
    files: set[str] = set()
    for one in specs:
        found = _expand_one(one)
        if not found:
            raise DataError(f"data path {one!r} matches no Parquet file "
                            f"(expected a file, a directory holding *{PARQUET_SUFFIX} files, "
                            "or a glob)")
        files.update(found)
    return sorted(files)


@contextlib.contextmanager
def open_parquet(path: str, read_dictionary: Sequence[str] | None = None
                 ) -> Iterator[pq.ParquetFile]:
    """Open ``path`` (local path or fsspec URL) as a ``ParquetFile``, reading its footer.

    ``read_dictionary`` names columns to decode as Arrow dictionaries (``pq.ParquetFile``'s
    option). A missing file or an unreadable footer raises :class:`DataError` naming the file.
    """
    with contextlib.ExitStack() as stack:
        try:
            source = stack.enter_context(fsspec.open(path, "rb")) if _is_url(path) else path
            parquet = stack.enter_context(
                pq.ParquetFile(source, read_dictionary=read_dictionary))
        except (OSError, pa.ArrowException) as exc:
            raise DataError(f"{path}: cannot read the Parquet footer ({exc}); expected a "
                            "complete Parquet file") from exc
        yield parquet


def row_groups(paths: Sequence[str]) -> list[RowGroup]:
    """The row groups of ``paths``, in path order then row-group order, from the footers only."""
    groups: list[RowGroup] = []
    for path in paths:
        with open_parquet(path) as parquet:
            metadata = parquet.metadata
            groups.extend(RowGroup(path, i, metadata.row_group(i).num_rows)
                          for i in range(metadata.num_row_groups))
    logger.debug("%d row group(s) in %d file(s)", len(groups), len(paths))
    return groups
