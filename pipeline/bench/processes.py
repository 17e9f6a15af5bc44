"""A real Dask cluster of processes on this machine: ``dask scheduler`` and ``dask worker``
commands on loopback, each in a process group of its own, so that one can be killed for real (a
worker process alone, which its nanny replaces; a nanny with its workers; the scheduler), and
all are killed at the end. The chaos benchmark and the end-to-end tests run their jobs on it.

A process can also be stopped (:func:`freeze`, SIGSTOP) and let go on (:func:`thaw`): a stopped
nanny does not replace its dead worker yet, and a stopped scheduler writes nothing, so what its
job's master wrote can be read and the whole cluster killed at a moment chosen on it
(:meth:`DaskProcesses.kill_when`) rather than a moment later."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import psutil
from distributed import Client

DASK = str(Path(sys.executable).parent / "dask")

T = TypeVar("T")


def wait_until(check: Callable[[], T], what: str, timeout_s: float = 90.0,
               poll_s: float = 0.05) -> T:
    """``check()``'s first truthy value, asked every ``poll_s``; :class:`TimeoutError` naming
    ``what`` was awaited once ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g}s for {what}")
        time.sleep(poll_s)
    return value


def stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (SIGSTOP takes effect a moment after
    it is sent)."""
    for thread in psutil.Process(pid).threads():
        try:
            if psutil.Process(thread.id).status() != psutil.STATUS_STOPPED:
                return False
        except psutil.NoSuchProcess:
            continue  # a thread that ended meanwhile
    return True


def freeze(pid: int) -> None:
    """Stop process ``pid`` (SIGSTOP); returns once it is stopped: until :func:`thaw` it writes,
    answers and starts nothing."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: stopped(pid), f"process {pid} to stop")


def thaw(pid: int) -> None:
    """Let a process stopped by :func:`freeze` go on (SIGCONT)."""
    os.kill(pid, signal.SIGCONT)


class DaskProcesses:
    """``dask scheduler`` on 127.0.0.1 in ``folder`` plus the ``dask worker`` commands
    :meth:`add_workers` starts; each command's output goes to a log file in ``folder``. ``tls``:
    ``(ca, cert, key)`` file paths every process uses; ``env``: variables every process gets
    besides this one's (e.g. ``DASK_CONFIG``)."""

    def __init__(self, folder: Path, tls: tuple[str, str, str] | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.folder = folder.resolve()  # the commands run in it: their paths must not be relative
        self.tls = tls
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.commands: list[subprocess.Popen[bytes]] = []
        scheduler_file = self.folder / "scheduler.json"
        scheduler_file.unlink(missing_ok=True)  # an earlier cluster's
        self.scheduler = self._start([DASK, "scheduler", "--host", "127.0.0.1", "--port", "0",
                                      "--dashboard-address", ":0", "--scheduler-file",
                                      str(scheduler_file), *self._tls_args()], "scheduler")
        wait_until(lambda: scheduler_file.exists() and scheduler_file.stat().st_size,
                   f"the scheduler's address file {scheduler_file}")
        self.address: str = json.loads(scheduler_file.read_text())["address"]

    def _tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        ca, cert, key = self.tls
        return ["--tls-ca-file", ca, "--tls-cert", cert, "--tls-key", key]

    def _start(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.folder / f"{name}-{len(self.commands)}.log", "wb")
        process = subprocess.Popen(args, cwd=self.folder, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=self.env)
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
        try:
            children = psutil.Process(command.pid).children()
        except psutil.NoSuchProcess:
            return []
        found = []
        for child in children:
            try:
                if " ".join(child.cmdline()).startswith("dask worker ["):  # process titles
                    found.append(child)
            except psutil.NoSuchProcess:
                continue
        return found

    def kill_group(self, command: subprocess.Popen[bytes]) -> None:
        """SIGKILL a command with every process it started (a nanny with its workers, or the
        scheduler)."""
        os.killpg(command.pid, signal.SIGKILL)
        command.wait(timeout=30)

    def __enter__(self) -> DaskProcesses:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def kill_when(self, check: Callable[[], T | None], what: str, timeout_s: float) -> T:
        """Kill every command (:meth:`close`) at a moment when ``check()`` holds of what the
        scheduler process wrote: once it holds, the scheduler is stopped and ``check()`` asked
        again; it is killed stopped if that holds still, else it goes on until ``check()`` holds
        again. ``check()``'s value at the kill; :class:`TimeoutError` naming ``what`` was
        awaited after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            wait_until(check, what, max(0.0, deadline - time.monotonic()))
            freeze(self.scheduler.pid)
            value = check()
            if value:
                self.close()
                return value
            thaw(self.scheduler.pid)

    def close(self) -> None:
        """Kill every command still running."""
        for command in reversed(self.commands):
            if command.poll() is None:
                os.killpg(command.pid, signal.SIGKILL)
                command.wait(timeout=30)

    def logs(self) -> str:
        """Every process's output so far (for a failure's message)."""
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}"
                         for path in sorted(self.folder.glob("*.log")))


def wait_for_workers(address: str, count: int, security: object = None,
                     timeout_s: float = 90.0) -> list[str]:
    """The scheduler's workers once it has ``count`` of them."""
    with Client(address, security=security, timeout="30s") as client:
        client.wait_for_workers(count, timeout=timeout_s)
        return sorted(client.sync(client.scheduler.identity, n_workers=-1)["workers"])
