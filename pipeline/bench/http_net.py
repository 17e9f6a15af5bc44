"""Data on the network, as a cluster reads its Parquet logs from remote storage: a folder served
over HTTP with byte ranges (:class:`FolderServer`), and a reader of ``http://`` URLs on the
standard library (:class:`RangeFileSystem`: fsspec's own HTTP filesystem needs aiohttp, which
this project does not install).

Importing this module registers :class:`RangeFileSystem` as fsspec's ``http`` protocol in the
importing process, so that :func:`data.files.open_parquet` and :func:`data.files.expand` read
``http://host:port/path.parquet`` URLs through it: a
:class:`~pipeline.bench.network.NetworkCluster`'s workers import it as they start (``dask worker
--preload``), a benchmark that serves its data imports it itself. A URL names one file: the
filesystem lists no folders (a job names its files one by one). Each read is one ``GET`` with a
``Range`` header on a connection of its own, within :data:`TIMEOUT_S`; a file's bytes are
fetched with :data:`BLOCK_BYTES` more (fsspec's read-ahead cache), so a reader of a Parquet
row group fetches its column chunks, not the whole file.

The server answers ``HEAD`` (the size, ``Accept-Ranges: bytes``) and ``GET`` of a whole file or
of one range ``bytes=START-[END]`` (206 with ``Content-Range``; 416 outside the file); a path
outside its folder or missing is 404. It counts the bytes of file content it sent to each client
address (:meth:`FolderServer.sent`)."""

from __future__ import annotations

import re
import shutil
import threading
import urllib.error
import urllib.request
from collections import Counter
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import fsspec
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

TIMEOUT_S = 120.0
"""The longest one range request may take (a block over a throttled link takes seconds)."""

BLOCK_BYTES = 1 << 16
"""Bytes one request fetches past what was asked (fsspec's read-ahead block): small, since a
reader that asks for one row group's column chunks would fetch a whole block more than it
needs each time (with blocks of 1 MiB, twice the data crossed the links)."""

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Opens URLs without a proxy: the data is on the cluster's own network."""

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    """One request to a :class:`FolderServer` (the module's docstring)."""

    server: FolderServer

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a benchmark's output is its result."""

    def _answer(self, body: bool) -> None:
        path = self.server.file_of(self.path)
        if path is None:
            self.send_error(HTTPStatus.NOT_FOUND, f"no file {self.path!r} in the served folder")
            return
        size = path.stat().st_size
        start, end = 0, size
        wanted = self.headers.get("Range")
        if wanted is not None:
            match = _RANGE.match(wanted.strip())
            if match is None or int(match[1]) >= size:
                self.send_error(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE,
                                f"range {wanted!r} of a file of {size} bytes")
                return
            start, end = int(match[1]), min(size, int(match[2]) + 1 if match[2] else size)
        self.send_response(HTTPStatus.PARTIAL_CONTENT if wanted else HTTPStatus.OK)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start if body or wanted else size))
        if wanted:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if body:
            with open(path, "rb") as source:
                source.seek(start)
                shutil.copyfileobj(_Slice(source, end - start), self.wfile)
            self.server.count(self.client_address[0], end - start)


class _Slice:
    """The next ``left`` bytes of ``source``, read as a file (for ``shutil.copyfileobj``)."""

    def __init__(self, source: Any, left: int) -> None:
        self.source, self.left = source, left

    def read(self, size: int = -1) -> bytes:
        size = self.left if size < 0 else min(size, self.left)
        chunk = self.source.read(size)
        self.left -= len(chunk)
        return bytes(chunk)


class FolderServer(ThreadingHTTPServer):
    """``folder`` served at ``http://host:port/`` (port 0: any free one) from a daemon thread,
    started on construction; :meth:`close` stops it. See the module's docstring."""

    daemon_threads = True

    def __init__(self, folder: Path, host: str, port: int = 0) -> None:
        super().__init__((host, port), _Handler)
        self.folder = folder.resolve()
        self._sent: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self.serve_forever, name="antdt-http-data",
                                        daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The folder's URL, ending in ``/``."""
        host, port = self.socket.getsockname()[:2]
        return f"http://{host}:{port}/"

    def url_of(self, path: Path) -> str:
        """The URL of ``path``, a file under the served folder."""
        return self.url + path.resolve().relative_to(self.folder).as_posix()

    def file_of(self, request_path: str) -> Path | None:
        """The file a request's path names; None when it is missing or outside the folder."""
        path = (self.folder / unquote(urlsplit(request_path).path).lstrip("/")).resolve()
        return path if path.is_relative_to(self.folder) and path.is_file() else None

    def count(self, client: str, sent: int) -> None:
        with self._lock:
            self._sent[client] += sent

    def sent(self) -> dict[str, int]:
        """Bytes of file content sent so far, by client address."""
        with self._lock:
            return dict(self._sent)

    def close(self) -> None:
        """Stop serving and close the socket."""
        self.shutdown()
        self.server_close()
        self._thread.join()


class RangeFile(AbstractBufferedFile):  # type: ignore[misc]  # fsspec is untyped
    """One ``http://`` file open for reading: each block one ranged ``GET``."""

    DEFAULT_BLOCK_SIZE = BLOCK_BYTES

    def _fetch_range(self, start: int, end: int) -> bytes:
        if start >= end:
            return b""
        request = urllib.request.Request(self.path, headers={"Range": f"bytes={start}-{end - 1}"})
        with _OPENER.open(request, timeout=TIMEOUT_S) as answer:
            data = bytes(answer.read())
        if len(data) != end - start:
            raise OSError(f"{self.path}: asked for bytes {start}-{end - 1}, received "
                          f"{len(data)} bytes")
        return data


class RangeFileSystem(AbstractFileSystem):  # type: ignore[misc]  # fsspec is untyped
    """fsspec's ``http`` protocol on the standard library: files only (the module's
    docstring); a path is the whole URL."""

    protocol = ("http",)

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return path

    def unstrip_protocol(self, name: str) -> str:
        return name

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        request = urllib.request.Request(path, method="HEAD")
        try:
            with _OPENER.open(request, timeout=TIMEOUT_S) as answer:
                size = int(answer.headers["Content-Length"])
        except urllib.error.HTTPError as exc:
            if exc.code == HTTPStatus.NOT_FOUND:
                raise FileNotFoundError(path) from exc
            raise OSError(f"{path}: HEAD answered {exc.code} {exc.reason}") from exc
        return {"name": path, "size": size, "type": "file"}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        info = self.info(path)
        return [info] if detail else [info["name"]]

    def _open(self, path: str, mode: str = "rb", block_size: int | None = None,
              autocommit: bool = True, cache_options: dict[str, Any] | None = None,
              **kwargs: Any) -> RangeFile:
        if mode != "rb":
            raise NotImplementedError(f"{path}: http files open for reading only, not {mode!r}")
        return RangeFile(self, path, mode, block_size, autocommit, cache_options=cache_options,
                         size=self.info(path)["size"])


def served_files(server: FolderServer, paths: list[str]) -> list[str]:
    """The URLs of the Parquet files under ``paths`` (files or folders under the served
    folder), sorted."""
    files: list[Path] = []
    for path in map(Path, paths):
        files += sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
    return sorted(server.url_of(file) for file in files)


fsspec.register_implementation("http", RangeFileSystem, clobber=True)
