"""A cluster of hosts on one machine: ``dask scheduler`` and each ``dask worker`` in a network
namespace of its own with an address of its own, joined by a bridge, so that the network between
them can fail as it fails between machines. It needs root (``ip netns``, ``ip link``, ``tc``).

What :class:`NetworkCluster` builds, for an instance prefix ``P`` (``adt`` and four hex digits,
so that clusters started at once do not collide; every interface name stays within 15 chars)::

    host namespace: bridge Pbr, 10.a.b.1/24 (a random private /24 free on this machine)
      |-- Phs <-veth-> Pes in namespace P-s   10.a.b.2   dask scheduler, port 8786
      |-- Ph0 <-veth-> Pe0 in namespace P-w0  10.a.b.10  dask worker (a nanny, one thread)
      `-- Ph1 <-veth-> Pe1 in namespace P-w1  10.a.b.11  ...

The host is on the bridge, so a :class:`distributed.Client` in this process reaches the scheduler
(:attr:`NetworkCluster.address`) and the workers. Every process is started ``--host`` its own
address, in a process group of its own (as :class:`~pipeline.bench.processes.DaskProcesses`).

Faults are calls, each silent (packets are dropped, nothing is refused) until :meth:`heal`:

- ``cut(i)``: worker ``i``'s host end of its veth goes down: it is cut from everyone, the host
  included.
- ``cut(i, from_="scheduler")`` / ``cut(i, from_="peers")``: a permanent neighbour entry with a
  MAC address no one has, for the other side's address, in worker ``i``'s namespace and in the
  other side's: frames between the two go nowhere, and the rest of the network is untouched (this
  kernel has neither ``netem``, nor iptables, nor the ``tc`` drop action; a blackhole route would
  fail at once with EINVAL, a fast failure rather than a partition).
- ``throttle(i, rate)``: a ``tbf`` queue of ``rate`` (``tc`` units: ``"50mbit"``) on both ends
  of worker ``i``'s veth, its bucket a millisecond at that rate (:func:`burst_for`);
  ``throttle_all(rate)``: every worker's link.

What happens next is left to the kernel and to Dask: an open TCP connection across a cut
retransmits with backoff and fails only once ``distributed.comm.timeouts.tcp`` passes without
progress (a new one after ``distributed.comm.timeouts.connect``); a cut healed before that goes on
as if nothing happened. A test that wants a quick verdict sets those (``DASK_DISTRIBUTED__COMM__
TIMEOUTS__TCP=5s`` in ``env``).

Data on the network, as a production job's is on remote storage: :meth:`NetworkCluster.serve`
serves a folder over HTTP from the host's namespace at the bridge's address
(:mod:`pipeline.bench.http_net`), so that every byte a worker reads crosses its link; every
worker imports that module as it starts (``--preload``) and so reads ``http://`` URLs.
:meth:`NetworkCluster.link_bytes` counts the bytes that crossed a worker's link.

Nothing is left behind: :meth:`NetworkCluster.close` (on leaving the ``with`` block, at exit, on
SIGTERM) kills the processes and removes the namespaces and links; a cluster whose owner was
killed outright is removed by :func:`sweep`, which every new cluster calls first (a folder's
HTTP server stops with the cluster). An owner is
recorded as a file in :data:`OWNERS` naming its process id."""

from __future__ import annotations

import atexit
import ipaddress
import os
import random
import re
import signal
import socket
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path
from types import FrameType, TracebackType
from typing import Literal

from antdt.agent.modes.synchronous import GLOO_INTERFACE
from pipeline.bench.http_net import FolderServer
from pipeline.bench.processes import DASK, wait_for_workers, wait_until

MARK = "adt"
"""The first letters of every namespace and link a cluster makes (and :func:`sweep` removes)."""

OWNERS = Path("/run/antdt-netcluster") if os.access("/run", os.W_OK) \
    else Path("/tmp/antdt-netcluster")
"""One file per live cluster, named by its prefix, holding its owner's process id."""

SCHEDULER_PORT = 8786
NOWHERE = "02:00:00:00:00:01"
"""A locally administered MAC address no interface has: frames sent to it are dropped."""

ALLOW_FAULTS = "DASK_ANTDT__JOBS__ALLOW_FAULTS"
HOST_ONLY = (ALLOW_FAULTS, GLOO_INTERFACE)
"""Variables of this process its hosts do not inherit: whether faults are allowed (passed on
only when asked), and gloo's interface, a name on this host (a rank run in this process set it
to ``lo``): in a namespace each rank takes the interface of its own address."""

HTTP_READER = "pipeline.bench.http_net"
"""What every worker imports as it starts (``--preload``): the reader of ``http://`` data."""


def ip(*args: str, namespace: str | None = None, check: bool = True) -> str:
    """Run ``ip ARGS`` (or ``tc`` when ``args[0] == "tc"``), in ``namespace`` when given; its
    output. :class:`subprocess.CalledProcessError` carries stderr when ``check`` and it fails."""
    command = list(args) if args[0] == "tc" else ["ip", *args]
    if namespace is not None:
        command = ["ip", "netns", "exec", namespace, *command]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
    return done.stdout


def namespaces_available() -> str | None:
    """``None`` when this process can make network namespaces, else one line saying why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"{MARK}probe{os.getpid() % 10000}"
    try:
        ip("netns", "add", name)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"`ip netns add` failed: {getattr(exc, 'stderr', '') or exc}".strip()
    ip("netns", "del", name, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(prefix: str) -> int | None:
    try:
        return int((OWNERS / prefix).read_text())
    except (OSError, ValueError):
        return None


def leftovers(prefix: str = MARK) -> tuple[list[str], list[str]]:
    """The namespaces and host links whose names start with ``prefix``."""
    spaces = [line.split()[0] for line in ip("netns", "list", check=False).splitlines()
              if line.startswith(prefix)]
    links = [line.split(":")[1].strip().split("@")[0]
             for line in ip("-o", "link", "show", check=False).splitlines()
             if line.split(":")[1].strip().startswith(prefix)]
    return spaces, links


def remove(prefix: str) -> None:
    """Kill every process in the namespaces named ``prefix*``, delete them and the links named
    so (the bridge last), and forget the owner record; what is gone already is skipped."""
    spaces, links = leftovers(prefix)
    for space in spaces:
        for pid in ip("netns", "pids", space, check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        ip("netns", "del", space, check=False)
    for link in sorted(links, key=lambda name: name.endswith("br")):  # veths, then the bridge
        ip("link", "del", link, check=False)
    (OWNERS / prefix).unlink(missing_ok=True)


def sweep() -> list[str]:
    """Remove every cluster whose owner is no longer running (killed before it could clean
    up), as :func:`remove` does; the prefixes removed."""
    spaces, links = leftovers(MARK)
    prefixes = {name[:len(MARK) + 4] for name in spaces + links}
    prefixes |= {path.name for path in OWNERS.glob(f"{MARK}*")} if OWNERS.exists() else set()
    gone = sorted(p for p in prefixes if not ((owner := _owner(p)) and _alive(owner)))
    for prefix in gone:
        remove(prefix)
    return gone


_live: set[NetworkCluster] = set()
_live_lock = threading.Lock()


def _close_all() -> None:
    with _live_lock:
        clusters = list(_live)
    for cluster in clusters:
        cluster.close()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _close_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


atexit.register(_close_all)


_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def burst_for(rate: str) -> str:
    """A ``tbf`` bucket of a millisecond at ``rate`` (``tc`` units of bits: ``"20mbit"``),
    at least ``32kbit``.

    >>> burst_for("20mbit"), burst_for("1gbit")
    ('32kbit', '1000kbit')
    """
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate.strip().lower())
    if match is None:
        raise ValueError(f"link rate {rate!r}: expected a number and kbit, mbit or gbit "
                         "(e.g. 20mbit)")
    return f"{max(32, round(float(match[1]) * _UNITS[match[2]] / 1e6))}kbit"


def _free_subnet() -> ipaddress.IPv4Network:
    used = ip("-4", "-o", "addr", "show", check=False) + ip("-4", "route", "show", check=False)
    for _ in range(100):
        net = ipaddress.IPv4Network(f"10.{random.randint(16, 250)}.{random.randint(0, 255)}.0/24")
        if f"{'.'.join(str(net.network_address).split('.')[:3])}." not in used:
            return net
    raise RuntimeError("no free 10.x.y.0/24 on this machine")


Side = Literal["all", "scheduler", "peers"]


class NetworkCluster:
    """A scheduler and ``workers`` workers, each in a network namespace of its own (see the
    module's docstring), their logs in ``folder``. ``env``: variables every process gets besides
    this one's (the comm timeouts, a ``DASK_CONFIG``); ``allow_faults``: whether antdt's fault
    injection is allowed in them (``DASK_ANTDT__JOBS__ALLOW_FAULTS``, which is otherwise not
    passed on; nor is anything else of :data:`HOST_ONLY`). Started on construction;
    :meth:`close` (or leaving the ``with`` block) removes everything."""

    def __init__(self, folder: Path, workers: int = 2, env: Mapping[str, str] | None = None,
                 allow_faults: bool = False, timeout_s: float = 90.0) -> None:
        self.folder = folder.resolve()
        base = {k: v for k, v in os.environ.items() if k not in HOST_ONLY}
        self.env = {**base, "PYTHONUNBUFFERED": "1",
                    **({ALLOW_FAULTS: "true"} if allow_faults else {}), **(env or {})}
        self.commands: list[subprocess.Popen[bytes]] = []
        self._cuts: dict[int, list[tuple[str, str, str]]] = {}  # worker: (namespace, dev, addr)
        self._closed = False
        self._servers: list[FolderServer] = []
        sweep()
        OWNERS.mkdir(parents=True, exist_ok=True)
        while True:
            self.prefix = f"{MARK}{random.randrange(16 ** 4):04x}"
            try:
                with open(OWNERS / self.prefix, "x") as record:
                    record.write(str(os.getpid()))
                break
            except FileExistsError:
                continue
        with _live_lock:
            _live.add(self)
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            self._build(workers, timeout_s)
        except BaseException:
            self.close()
            raise

    # --- names and addresses

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def namespace(self, node: int | Literal["s"]) -> str:
        """The namespace of worker ``node`` or of the scheduler (``"s"``)."""
        return f"{self.prefix}-s" if node == "s" else f"{self.prefix}-w{node}"

    def host_link(self, node: int | Literal["s"]) -> str:
        """The host end of the node's veth (on the bridge)."""
        return f"{self.prefix}h{node}"

    def inner_link(self, node: int | Literal["s"]) -> str:
        """The node's end of its veth, in its namespace."""
        return f"{self.prefix}e{node}"

    def ip(self, node: int | Literal["s"]) -> str:
        """The address of worker ``node``, or of the scheduler (``"s"``)."""
        return str(self.subnet.network_address + (2 if node == "s" else 10 + node))

    @property
    def address(self) -> str:
        """The scheduler's address, reachable from this process."""
        return f"tcp://{self.ip('s')}:{SCHEDULER_PORT}"

    # --- building

    def _build(self, workers: int, timeout_s: float) -> None:
        self.subnet = _free_subnet()
        self.count = workers
        gateway = f"{self.subnet.network_address + 1}/{self.subnet.prefixlen}"
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", gateway, "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        nodes: list[int | Literal["s"]] = ["s", *range(workers)]
        for node in nodes:
            self._add_node(node)
        self.scheduler = self._start("s", [DASK, "scheduler", "--host", self.ip("s"), "--port",
                                           str(SCHEDULER_PORT), "--dashboard-address", ":0"])
        wait_until(self._scheduler_listens, f"the scheduler at {self.address}", timeout_s)
        self.worker_commands = [self._start(i, self._worker_command(i)) for i in range(workers)]
        self.workers = self.wait_for_workers(timeout_s)

    def _worker_command(self, node: int) -> list[str]:
        return [DASK, "worker", self.address, "--host", self.ip(node), "--nthreads", "1",
                "--nworkers", "1", "--name", f"w{node}", "--dashboard-address", ":0",
                "--preload", HTTP_READER]

    def restart(self, worker: int) -> None:
        """Start worker ``worker``'s command again once it exited (as a deployment restarts
        what exits: a worker the scheduler dropped closes itself, its nanny too); it joins as
        a new worker, at a new port."""
        if self.worker_commands[worker].poll() is None:
            raise RuntimeError(f"worker {worker} still runs: stop it before it is restarted")
        self.worker_commands[worker] = self._start(worker, self._worker_command(worker))

    def _add_node(self, node: int | Literal["s"]) -> None:
        space, host, inner = self.namespace(node), self.host_link(node), self.inner_link(node)
        ip("netns", "add", space)
        ip("link", "add", host, "type", "veth", "peer", "name", inner)
        ip("link", "set", inner, "netns", space)
        ip("link", "set", host, "master", self.bridge)
        ip("link", "set", host, "up")
        ip("addr", "add", f"{self.ip(node)}/{self.subnet.prefixlen}", "dev", inner,
           namespace=space)
        ip("link", "set", inner, "up", namespace=space)
        ip("link", "set", "lo", "up", namespace=space)

    def _start(self, node: int | Literal["s"], args: list[str]) -> subprocess.Popen[bytes]:
        name = "scheduler" if node == "s" else f"worker-{node}"
        log = open(self.folder / f"{name}.log", "ab")
        process = subprocess.Popen(["ip", "netns", "exec", self.namespace(node), *args],
                                   cwd=self.folder, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=self.env)
        self.commands.append(process)
        return process

    def _scheduler_listens(self) -> bool:
        try:
            socket.create_connection((self.ip("s"), SCHEDULER_PORT), timeout=1).close()
        except OSError:
            return False
        return True

    def wait_for_workers(self, timeout_s: float = 90.0) -> list[str]:
        """Once every worker has joined, their addresses, worker ``i``'s at index ``i`` (a
        worker its nanny restarted has a new port)."""
        found = wait_for_workers(self.address, self.count, timeout_s=timeout_s)
        by_ip = {address.rsplit(":", 1)[0].removeprefix("tcp://"): address for address in found}
        return [by_ip[self.ip(i)] for i in range(self.count)]

    # --- faults

    def cut(self, worker: int, from_: Side = "all") -> None:
        """Drop every packet between worker ``worker`` and everyone (``"all"``: its link goes
        down, the host too loses it), the scheduler only, or the other workers only."""
        if from_ == "all":
            ip("link", "set", self.host_link(worker), "down")
            return
        others: list[int | Literal["s"]] = ["s"] if from_ == "scheduler" else \
            [i for i in range(self.count) if i != worker]
        entries = self._cuts.setdefault(worker, [])
        for other in others:
            for node, far in ((worker, other), (other, worker)):
                entry = (self.namespace(node), self.inner_link(node), self.ip(far))
                ip("neigh", "replace", entry[2], "lladdr", NOWHERE, "nud", "permanent", "dev",
                   entry[1], namespace=entry[0])
                entries.append(entry)

    def throttle(self, worker: int, rate: str, burst: str | None = None,
                 latency: str = "400ms") -> None:
        """Limit worker ``worker``'s link to ``rate`` each way (``tc`` units, ``"50mbit"``);
        its bucket ``burst`` (default :func:`burst_for` the rate: a bucket much smaller than a
        millisecond's bytes holds a fast link below its rate)."""
        for link, space in ((self.host_link(worker), None),
                            (self.inner_link(worker), self.namespace(worker))):
            ip("tc", "qdisc", "replace", "dev", link, "root", "tbf", "rate", rate, "burst",
               burst or burst_for(rate), "latency", latency, namespace=space)

    def throttle_all(self, rate: str) -> None:
        """Limit every worker's link to ``rate`` each way, as :meth:`throttle` does."""
        for worker in range(self.count):
            self.throttle(worker, rate)

    def heal(self, worker: int) -> None:
        """Undo every cut and throttle of worker ``worker``."""
        ip("link", "set", self.host_link(worker), "up")
        for space, dev, address in self._cuts.pop(worker, []):
            ip("neigh", "del", address, "dev", dev, namespace=space, check=False)
        ip("tc", "qdisc", "del", "dev", self.host_link(worker), "root", check=False)
        ip("tc", "qdisc", "del", "dev", self.inner_link(worker), "root",
           namespace=self.namespace(worker), check=False)

    # --- data and what crossed the links

    def serve(self, folder: Path) -> FolderServer:
        """``folder`` served over HTTP from this (the host's) namespace at the bridge's address,
        every worker's link between it and them (:mod:`pipeline.bench.http_net`); stopped by
        :meth:`close`."""
        server = FolderServer(folder, str(self.subnet.network_address + 1))
        self._servers.append(server)
        return server

    def link_bytes(self, worker: int) -> int:
        """Bytes that crossed worker ``worker``'s link so far, both ways (its veth's counters
        on the host's side: data, the scheduler's messages and its peers' alike)."""
        stats = Path("/sys/class/net") / self.host_link(worker) / "statistics"
        return sum(int((stats / name).read_text()) for name in ("rx_bytes", "tx_bytes"))

    # --- the end

    def __enter__(self) -> NetworkCluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process, then remove the namespaces, links and owner record."""
        if self._closed:
            return
        self._closed = True
        for server in self._servers:
            server.close()
        for command in reversed(self.commands):
            if command.poll() is None:
                try:
                    os.killpg(command.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                command.wait(timeout=30)
        remove(self.prefix)
        with _live_lock:
            _live.discard(self)

    def logs(self) -> str:
        """Every process's output so far (for a failure's message)."""
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}"
                         for path in sorted(self.folder.glob("*.log")))

