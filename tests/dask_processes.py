"""A real Dask cluster for end-to-end tests: ``dask scheduler`` and ``dask worker`` processes on
loopback, each command in a process group of its own (so a test can kill a worker process, or a
nanny together with its worker), all killed at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType

import psutil

from waits import bounded

DASK = str(Path(sys.executable).parent / "dask")


class DaskProcesses:
    """``dask scheduler`` on 127.0.0.1 plus the ``dask worker`` commands :meth:`add_workers`
    starts. ``tls``: ``(ca, cert, key)`` file paths every process uses."""

    def __init__(self, folder: Path, tls: tuple[str, str, str] | None = None) -> None:
        self.folder = folder
        self.tls = tls
        self.commands: list[subprocess.Popen[bytes]] = []
        scheduler_file = folder / "scheduler.json"
        scheduler_file.unlink(missing_ok=True)  # an earlier cluster's
        self.scheduler = self._start([DASK, "scheduler", "--host", "127.0.0.1", "--port", "0",
                                      "--dashboard-address", ":0", "--scheduler-file",
                                      str(scheduler_file), *self._tls_args()], "scheduler")
        bounded.until(lambda: scheduler_file.exists() and scheduler_file.stat().st_size,
                      "the scheduler's address file")
        self.address: str = json.loads(scheduler_file.read_text())["address"]

    def _tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        ca, cert, key = self.tls
        return ["--tls-ca-file", ca, "--tls-cert", cert, "--tls-key", key]

    def _start(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.folder / f"{name}-{len(self.commands)}.log", "wb")
        process = subprocess.Popen(args, cwd=self.folder, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env={**os.environ,
                                                                "PYTHONUNBUFFERED": "1"})
        self.commands.append(process)
        return process

    def add_workers(self, count: int) -> subprocess.Popen[bytes]:
        """One ``dask worker --nworkers count`` command (its nannies in one process, each
        with a worker process of one thread)."""
        return self._start([DASK, "worker", self.address, "--nworkers", str(count),
                            "--nthreads", "1", "--host", "127.0.0.1", "--dashboard-address",
                            ":0", *self._tls_args()], "worker")

    def worker_processes(self, command: subprocess.Popen[bytes]) -> list[psutil.Process]:
        """The worker processes (not the nannies) a ``dask worker`` command started."""
        return [p for p in psutil.Process(command.pid).children()
                if " ".join(p.cmdline()).startswith("dask worker [")]  # their process titles

    def kill_group(self, command: subprocess.Popen[bytes]) -> None:
        """SIGKILL a command with every process it started (a nanny with its workers)."""
        os.killpg(command.pid, signal.SIGKILL)
        command.wait(timeout=30)

    def __enter__(self) -> DaskProcesses:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for command in reversed(self.commands):
            if command.poll() is None:
                os.killpg(command.pid, signal.SIGKILL)
                command.wait(timeout=30)

    def logs(self) -> str:
        """Every process's output so far (for a failing test's message)."""
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}"
                         for path in sorted(self.folder.glob("*.log")))


def wait_for_workers(address: str, count: int, security: object = None,
                     timeout_s: float = 90.0) -> list[str]:
    """The scheduler's workers once it has ``count`` of them."""
    from distributed import Client

    with Client(address, security=security, timeout="30s") as client:
        client.wait_for_workers(count, timeout=timeout_s)
        return sorted(client.sync(client.scheduler.identity, n_workers=-1)["workers"])
