"""The cluster of hosts on one machine (:mod:`pipeline.bench.network`): every process in a network
namespace of its own at its own address; a worker cut from everyone, or from the scheduler only,
runs nothing until healed; one cut from the scheduler is still reached by the host and its peers,
one cut from its peers by the host and the scheduler; a throttle is a ``tbf`` queue on its link;
and nothing named after the cluster is left once it is closed."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
from distributed import Client, get_worker, wait

from antdt.agent.modes.synchronous import GLOO_INTERFACE
from pipeline.bench.network import NetworkCluster, leftovers, namespaces_available
from waits import bounded

WHY_NOT = namespaces_available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")

# the cut is healed before TCP gives up on it; short timeouts only bound a test that goes wrong
ENV = {"DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "10s",
       "DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": "30s"}


@pytest.mark.slow
def test_workers_have_addresses_of_their_own_and_a_cut_one_runs_nothing_until_healed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def where() -> str:  # defined here so that it is pickled by value: the test module is not
        return str(get_worker().address)  # importable in the cluster's processes

    def gloo_interface() -> str | None:
        return os.environ.get(GLOO_INTERFACE)

    def reachable(host: str, port: int) -> bool:
        try:
            socket.create_connection((host, port), timeout=2).close()
        except OSError:
            return False
        return True

    monkeypatch.setenv(GLOO_INTERFACE, "lo")  # as a rank run in this process left it
    with NetworkCluster(tmp_path, workers=2, env=ENV) as net, \
            Client(net.address, timeout="30s") as client:
        prefix = net.prefix
        for i, address in enumerate(net.workers):
            assert address.startswith(f"tcp://{net.ip(i)}:") and "127.0.0.1" not in address
        ran = bounded.gather(client, [client.submit(where, workers=[net.ip(i)], pure=False)
                                      for i in range(2)])
        assert ran == net.workers
        # each host's ranks take the interface of its own address, not this host's loopback
        assert set(client.run(gloo_interface).values()) == {None}

        net.cut(1)
        cut = client.submit(where, workers=[net.ip(1)], allow_other_workers=False, pure=False)
        fine = client.submit(where, workers=[net.ip(0)], allow_other_workers=False, pure=False)
        assert bounded.result(fine) == net.workers[0]
        with pytest.raises(TimeoutError):
            wait(cut, timeout=2)  # the one wait for a duration: that nothing happens
        net.heal(1)
        assert bounded.result(cut).startswith(f"tcp://{net.ip(1)}:"), net.logs()

        port = int(net.workers[1].rsplit(":", 1)[1])
        on_0 = {"workers": [net.ip(0)], "allow_other_workers": False, "pure": False}
        net.cut(1, from_="scheduler")
        assert reachable(net.ip(1), port)  # from the host
        assert bounded.result(client.submit(reachable, net.ip(1), port, **on_0))  # from a peer
        cut = client.submit(where, workers=[net.ip(1)], allow_other_workers=False, pure=False)
        with pytest.raises(TimeoutError):
            wait(cut, timeout=2)
        net.heal(1)
        assert bounded.result(cut).startswith(f"tcp://{net.ip(1)}:"), net.logs()

        net.cut(1, from_="peers")
        assert reachable(net.ip(1), port)
        assert not bounded.result(client.submit(reachable, net.ip(1), port, **on_0))
        assert bounded.result(client.submit(where, workers=[net.ip(1)], pure=False)) \
            .startswith(f"tcp://{net.ip(1)}:")  # the scheduler still reaches it
        net.heal(1)
        assert bounded.result(client.submit(reachable, net.ip(1), port, **on_0))

        net.throttle(1, "50mbit")
        shown = subprocess.run(["tc", "qdisc", "show", "dev", net.host_link(1)],
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in shown and "50Mbit" in shown
        net.heal(1)
        assert bounded.result(client.submit(where, workers=[net.ip(1)], pure=False)) \
            .startswith(f"tcp://{net.ip(1)}:")
    assert leftovers(prefix) == ([], [])
