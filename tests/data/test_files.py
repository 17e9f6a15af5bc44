"""Finding Parquet files (paths, directories, globs, fsspec URLs) and their row groups."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from antdt.errors import DataError
from data.files import RowGroup, expand, row_groups


def write(path: Path, rows: int, row_group_rows: int) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"x": range(rows)}), path, row_group_size=row_group_rows)
    return str(path)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """date=2026-11-01 .. 07, two files a day, plus files that are not Parquet data."""
    for day in range(1, 8):
        for part in (1, 0):
            write(tmp_path / f"date=2026-11-0{day}" / f"part-0000{part}.parquet", 10, 4)
    (tmp_path / "schema.yaml").write_text("label: y\n")
    (tmp_path / "date=2026-11-01" / "_SUCCESS").write_text("")
    write(tmp_path / "nested" / "deeper" / "part-00000.parquet", 3, 4)
    return tmp_path


def names(paths: list[str], root: Path) -> list[str]:
    return [str(Path(p).relative_to(root)) for p in paths]


def test_directory_is_searched_recursively_and_sorted(tree: Path) -> None:
    files = expand(str(tree))
    assert len(files) == 15
    assert files == sorted(files)
    assert names(files, tree)[:2] == ["date=2026-11-01/part-00000.parquet",
                                      "date=2026-11-01/part-00001.parquet"]
    assert names(files, tree)[-1] == "nested/deeper/part-00000.parquet"


def test_globs_of_directories_and_files(tree: Path) -> None:
    days = expand(str(tree / "date=2026-11-0[1-5]"))
    assert len(days) == 10
    assert {Path(p).parent.name for p in days} == {f"date=2026-11-0{d}" for d in range(1, 6)}
    everything = expand(str(tree / "**" / "*.parquet"))
    assert everything == expand(str(tree))
    assert expand(str(tree / "date=*" / "part-00001.parquet")) == \
        sorted(str(tree / f"date=2026-11-0{d}" / "part-00001.parquet") for d in range(1, 8))


def test_lists_are_merged_sorted_and_deduplicated(tree: Path) -> None:
    one = str(tree / "date=2026-11-02" / "part-00000.parquet")
    files = expand([str(tree / "date=2026-11-02"), one, str(tree / "date=2026-11-01")])
    assert names(files, tree) == [f"date=2026-11-0{d}/part-0000{p}.parquet"
                                  for d in (1, 2) for p in (0, 1)]


def test_a_named_file_is_taken_whatever_its_suffix(tmp_path: Path) -> None:
    path = write(tmp_path / "data.pq", 5, 5)
    assert expand(path) == [path]


@pytest.mark.parametrize("spec", ["missing-dir", "date=2026-12-*", "schema.yaml/*", "nested/*.csv"])
def test_no_match_raises_naming_the_spec(tree: Path, spec: str) -> None:
    with pytest.raises(DataError) as info:
        expand(str(tree / spec))
    assert repr(str(tree / spec)) in str(info.value)
    assert "matches no Parquet file" in str(info.value)


def test_empty_list_is_an_error() -> None:
    with pytest.raises(DataError, match="no data paths given"):
        expand([])


def test_fsspec_urls(tree: Path) -> None:
    local = expand(str(tree / "date=2026-11-03"))
    urls = expand(f"file://{tree}/date=2026-11-03")
    assert urls == [f"file://{p}" for p in local]
    assert row_groups(urls) == [RowGroup(u, g.index, g.num_rows)
                                for u in urls for g in row_groups([u[len("file://"):]])]
    fs = fsspec.filesystem("memory")
    for day in ("a", "b"):
        with fs.open(f"/expand-test/day={day}/part-0.parquet", "wb") as fh:
            pq.write_table(pa.table({"x": range(5)}), fh, row_group_size=2)
    try:
        files = expand("memory://expand-test")
        assert files == ["memory:///expand-test/day=a/part-0.parquet",
                         "memory:///expand-test/day=b/part-0.parquet"]
        assert expand("memory://expand-test/day=[b]") == files[1:]
        assert [g.num_rows for g in row_groups(files)] == [2, 2, 1, 2, 2, 1]
    finally:
        fs.rm("/expand-test", recursive=True)


def test_row_groups_from_footers(tmp_path: Path) -> None:
    first = write(tmp_path / "a.parquet", 10, 4)
    second = write(tmp_path / "b.parquet", 3, 4)
    assert row_groups([first, second]) == [RowGroup(first, 0, 4), RowGroup(first, 1, 4),
                                           RowGroup(first, 2, 2), RowGroup(second, 0, 3)]
    assert row_groups([]) == []


def test_unreadable_footer_names_the_file(tmp_path: Path) -> None:
    good = write(tmp_path / "good.parquet", 10, 4)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(Path(good).read_bytes()[:-20])
    for bad in (str(truncated), str(tmp_path / "missing.parquet")):
        with pytest.raises(DataError) as info:
            row_groups([good, bad])
        assert str(info.value).startswith(f"{bad}: cannot read the Parquet footer")
