"""Data on the network (:mod:`pipeline.bench.http_net`): a folder served over HTTP with byte
ranges, read back through fsspec's ``http`` protocol as the job's reader reads it: the same
rows, the bytes sent counted, a missing file or a range past the end refused."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from antdt.errors import DataError
from data.files import expand, open_parquet, row_groups
from pipeline.bench.http_net import FolderServer, served_files


@pytest.fixture
def served(tmp_path: Path) -> Iterator[FolderServer]:
    day = tmp_path / "date=2026-11-01"
    day.mkdir()
    for part in range(2):
        pq.write_table(pa.table({"x": range(part * 100, part * 100 + 100)}),
                       day / f"part-{part:05d}.parquet", row_group_size=30)
    server = FolderServer(tmp_path, "127.0.0.1")
    yield server
    server.close()


def test_a_served_file_reads_as_the_local_one_row_group_by_row_group(
        served: FolderServer) -> None:
    urls = served_files(served, [str(served.folder / "date=2026-11-01")])
    assert urls == [f"{served.url}date=2026-11-01/part-0000{i}.parquet" for i in range(2)]
    assert expand(urls) == urls
    assert [(g.path, g.index, g.num_rows) for g in row_groups(urls)][:5] == \
        [(urls[0], 0, 30), (urls[0], 1, 30), (urls[0], 2, 30), (urls[0], 3, 10), (urls[1], 0, 30)]
    with open_parquet(urls[1]) as parquet:
        assert parquet.read_row_group(2).column("x").to_pylist() == list(range(160, 190))
    assert 0 < served.sent()["127.0.0.1"] <= sum(
        (served.folder / "date=2026-11-01" / f"part-0000{i}.parquet").stat().st_size * 2
        for i in range(2))


def test_a_range_past_the_end_or_a_file_outside_the_folder_is_refused(
        served: FolderServer) -> None:
    url = served_files(served, [str(served.folder)])[0]
    size = (served.folder / "date=2026-11-01" / "part-00000.parquet").stat().st_size
    with urllib.request.urlopen(urllib.request.Request(
            url, headers={"Range": f"bytes={size - 4}-"})) as answer:
        assert answer.status == 206 and answer.read() == b"PAR1"
        assert answer.headers["Content-Range"] == f"bytes {size - 4}-{size - 1}/{size}"
    with pytest.raises(urllib.error.HTTPError, match="416"):
        urllib.request.urlopen(urllib.request.Request(url, headers={"Range": f"bytes={size}-"}))
    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(f"{served.url}..%2F..%2Fetc%2Fpasswd")
    with pytest.raises(DataError, match="nothing.parquet"):
        with open_parquet(f"{served.url}nothing.parquet"):
            pass
