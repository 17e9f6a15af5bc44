"""SyncPeriod (how often a round starts, read back from what it writes) and Staleness (how far
training may run ahead of its rounds)."""

from __future__ import annotations

import pytest

import antdt.errors
from antdt.sync import Staleness, SyncPeriod
from waits import bounded


@pytest.mark.parametrize("period", [SyncPeriod(seconds=0.25), SyncPeriod(seconds=3.0),
                                    SyncPeriod(batches=1), SyncPeriod(batches=16),
                                    SyncPeriod(peer_batches=1), SyncPeriod(peer_batches=4)],
                         ids=str)
def test_a_sync_period_reads_back_what_it_writes(period: SyncPeriod) -> None:
    assert SyncPeriod.parse(str(period)) == period


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "expected seconds, batches or peer batches (one of them)"),
    ({"seconds": 1.0, "batches": 2}, "expected seconds, batches or peer batches (one of them)"),
    ({"batches": 1, "peer_batches": 2}, "expected seconds, batches or peer batches"),
    ({"seconds": float("inf")}, "seconds must be a finite number > 0, found inf"),
    ({"batches": 0}, "batches must be an int >= 1, found 0"),
    ({"batches": 1.5}, "batches must be an int >= 1, found 1.5"),
    ({"peer_batches": 0}, "peer batches must be an int >= 1, found 0"),
])
def test_a_sync_period_refuses_what_it_cannot_mean(kwargs: dict[str, float],
                                                   message: str) -> None:
    with pytest.raises(antdt.errors.ConfigError) as info:
        SyncPeriod(**kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_a_period_in_peer_batches_keeps_what_a_replica_has_not_seen_of_its_peers() -> None:
    period = SyncPeriod.parse("6 peer batches")
    assert period == SyncPeriod(peer_batches=6)
    # members - 1 peers, each training about the period's own batches between two rounds
    assert {members: period.batches_for(members) for members in range(1, 9)} == \
        {1: 6, 2: 6, 3: 3, 4: 2, 5: 1, 6: 1, 7: 1, 8: 1}
    assert all((members - 1) * (period.batches_for(members) or 0) <= 6
               for members in range(2, 8))


def test_staleness_holds_the_step_until_a_round_covers_the_batches() -> None:
    gate = Staleness(bound=1)
    for _ in range(3):
        gate.trained()
    covered = gate.round_started()  # a round covering 3 batches starts ...
    waiting = bounded.start(gate.wait, 60.0)
    gate.round_ended(covered)  # ... and ends: the step may go
    assert waiting.result() < 60.0 and gate.lag == 0
    gate.trained()
    gate.trained()
    assert gate.wait(timeout_s=0.05) >= 0.05  # no round: the wait runs out, training goes on
    gate.release()
    assert gate.wait(timeout_s=60.0) == 0.0  # the sync stopped: never wait again
    assert Staleness(bound=None).wait(timeout_s=60.0) == 0.0


def test_staleness_bounds_the_lag_past_the_sync_period() -> None:
    gate = Staleness(bound=1)
    gate.follow(period_batches=4)  # a round every 4 batches: the lag reaches 4 before it starts
    assert gate.limit == 4
    for _ in range(5):
        gate.trained()
    assert gate.wait(timeout_s=0.05) >= 0.05  # 5 > 4: the step waits
    waiting = bounded.start(gate.wait, 60.0)
    gate.follow(period_batches=8)  # a member left: the wider period releases the wait
    assert waiting.result() < 60.0 and gate.limit == 8
    gate.follow(None)  # a period in seconds: the bound alone
    assert gate.limit == 1 and Staleness(bound=None).limit is None


def test_a_staleness_bound_in_peer_batches_follows_the_members() -> None:
    gate = Staleness("2 peer batches")
    gate.follow(period_batches=4, members=2)  # one peer: its 2 batches are 2 of ours
    assert (gate.batches, gate.limit) == (2, 5)
    for _ in range(5):
        gate.trained()
    assert gate.wait(timeout_s=60.0) == 0.0  # a round may take 2 batches before training waits
    gate.follow(period_batches=4, members=3)  # a member joined: 2 peer batches are 1 of ours
    assert gate.limit == 4 and gate.wait(timeout_s=0.05) >= 0.05
    gate.follow(period_batches=4, members=1)  # alone: the whole bound
    assert gate.batches == 2 and gate.wait(timeout_s=60.0) == 0.0
    assert Staleness("3 batches").batches == 3  # own batches, whatever the members


def test_a_bad_staleness_bound_is_refused() -> None:
    for bad in (-1, 1.5, True, "1", "0 peer batches", "2 peers"):
        with pytest.raises(antdt.errors.ConfigError, match="max staleness"):
            Staleness(bad)
