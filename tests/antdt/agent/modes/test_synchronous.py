"""The synchronous mode's measure of a rank's own time, on a real gloo group of spawned ranks (the
step loop itself runs in tests/pipeline/training/test_sync_mode.py)."""

from __future__ import annotations

import time

import pytest

from antdt.agent.modes.synchronous import own_seconds
from ranks import Ranks
from sharded_ranks import wait_in_a_collective


def test_own_seconds_count_computing_not_sleeping() -> None:
    began, own_began = time.perf_counter(), own_seconds()
    while time.perf_counter() - began < 0.2:
        pass
    computed = own_seconds() - own_began
    time.sleep(0.3)
    slept = own_seconds() - own_began - computed
    assert computed >= 0.19 and slept < 0.1


@pytest.mark.slow
def test_a_rank_waiting_for_its_peer_in_a_collective_is_not_busy() -> None:
    """Rank 1 computes for 0.5 s before an all-reduce, rank 0 waits for it there (as a rank
    with a small local batch waits for the busiest inside a step): rank 0's wall time covers
    the wait, its own time, which the step loop reports to the controller, does not. Measured
    by wall time, every rank of a step would look as slow as the busiest, and a slow rank's
    local batch would shrink without end."""
    with Ranks(2) as ranks:
        (wall0, own0), (wall1, own1) = ranks.run(wait_in_a_collective, 0.5)
    assert wall0 >= 0.45 and own0 < 0.2 * wall0, (wall0, own0)
    assert own1 >= 0.45 and wall1 >= 0.45, (wall1, own1)
